"""Multi-process integration: the DeepSpeed launcher with CPU ranks, the real trainer.

- the gradient of one step does not depend on ranks, micro-batch size or ZeRO stage;
- `deepspeed --num_gpus 2 train.py` runs, writes metrics and a loadable checkpoint;
- --resume continues exactly as the uninterrupted run;
- reward rises on the built-in task.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from grpo.training.checkpoint import LATEST
from grpo.training.metrics import read_metrics
from tests.conftest import run_deepspeed
from tests.dist_grad_worker import per_aggregation

pytestmark = pytest.mark.slow

TINY_RUN = ["--config", "configs/demo.yaml", "logging.progress_bar=false", "rollout.prompts_per_step=4",
            "rollout.num_generations=4", "train.micro_batch_size=5", "logging.log_every=1"]


@pytest.fixture(scope="module")
def grads(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("grads")
    builtin = "builtin:tiny-char"
    # one launch per world size (each launch costs the ranks' start-up): 1 rank, then the four 2-rank runs;
    # the last: the same weights from an HF folder, built partitioned from the start (zero.Init)
    # the LoRA adapters' gradient (NAME+lora) rides in the same two launches
    run_deepspeed(["--out", str(out / "w1.pt"), "--run", f"w1-mb16-z0:16:0:{builtin}", "--run", "w1-mb16-z0+lora:16:0"], 1,
                  "tests/dist_grad_worker.py")
    runs = ["w2-mb3-z0:3:0", "w2-mb5-z2:5:2", "w2-mb5-z3:5:3", "w2-tok12-z3:16/12:3", f"w2-mb5-z3-built-partitioned:5:3:{tiny_dir}",
            "w2-mb3-z2+lora:3:2"]
    run_deepspeed(["--out", str(out / "w2.pt"), *[a for r in runs for a in ("--run", r)]], 2,
                  "tests/dist_grad_worker.py")
    return {**torch.load(out / "w1.pt"), **torch.load(out / "w2.pt")}


@pytest.mark.parametrize("other", ["w2-mb3-z0", "w2-mb5-z2", "w2-mb5-z3", "w2-tok12-z3", "w2-mb5-z3-built-partitioned",
                                   "w2-mb3-z2+lora"])
def test_step_gradient_independent_of_ranks_and_micro_batches(grads, other):
    """With ``+lora`` the policy has LoRA adapters (B made non-zero) and the gradient is the adapters' (small) one:
    2 ranks x micro-batches of 3 under ZeRO-2 against 1 rank x 1 micro-batch."""
    lora = other.endswith("+lora")
    ref = grads["w1-mb16-z0+lora" if lora else "w1-mb16-z0"]
    if other == "w2-tok12-z3":  # a 12-token budget: 6 micro-batches on rank 0, 7 on rank 1; both run 7 passes
        assert grads[other]["micro_batches_per_rank"] == [6, 7]
        assert grads[other]["passes_per_rank"] == [7, 7]
    if other.startswith("w2-mb5-z3"):  # ZeRO-3: the ranks ran unequal numbers of LM-head chunks (padded with empty ones)
        per_rank = grads[other]["head_chunks_per_rank"]
        assert per_rank[0] != per_rank[1], per_rank
    # the entropy's gradient (algo.entropy_coef = 0.5 on seq-mean-token-mean) is checked alike, and it moves the weights
    bonus, plain = ref["entropy-bonus"], ref["seq-mean-token-mean"]
    assert (bonus["grad"] - plain["grad"]).abs().max() > 1e-3 * plain["grad"].abs().max()
    for aggregation, r in per_aggregation(ref).items():
        o = grads[other][aggregation]
        assert r["grad"].abs().max() > (1e-4 if lora else 1e-3)  # a real, non-zero gradient
        if lora:
            assert r["grad"].numel() < 20_000  # the adapters' only
        torch.testing.assert_close(o["grad"], r["grad"], rtol=1e-4, atol=1e-6 * r["grad"].abs().max().item(),
                                   msg=f"{aggregation}: {other} differs from one rank, one micro-batch")
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6)


def test_zero3_generation_and_evaluation_stay_in_step(tmp_path, tiny_dir):
    """Under ZeRO-3 (weights partitioned) ranks with unequal generation work neither hang nor differ; models
    built partitioned hold the whole model's weights, the partitioned reference answers like it, and it is
    synced (mixed, reloaded) by the formula."""
    out = tmp_path / "checks.json"
    run_deepspeed(["--out", str(out), "--model", str(tiny_dir)], 2, "tests/zero3_generate_worker.py")
    checks = json.loads(out.read_text())
    assert len(checks) == 18, checks
    assert all(checks.values()), [k for k, ok in checks.items() if not ok]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """4 steps on 2 ranks with a checkpoint every 2 steps (the uninterrupted run)."""
    out = tmp_path_factory.mktemp("full") / "run"
    run_deepspeed(TINY_RUN + ["train.max_steps=4", "train.save_every=2", "algo.beta=0.04", f"train.output_dir={out}"])
    return out


def test_two_ranks_write_metrics_and_checkpoint(full_run):
    rows = read_metrics(full_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward/mean", "reward/digits_match/mean", "advantage/std", "loss", "kl", "clip_frac_low",
                "clip_frac_high", "completion/length_mean", "completion/truncated_frac", "lr", "grad_norm",
                "time/generation", "time/reward", "time/reference", "time/train", "tokens_per_sec"):
        assert key in rows[-1], key
    assert rows[-1]["kl"] is not None and rows[-1]["kl"] >= 0
    ckpt = full_run / "checkpoints"
    assert (ckpt / LATEST).is_symlink() and os.readlink(ckpt / LATEST) == "step-4"  # relative: the run folder moves
    assert not list(ckpt.glob(".tmp-*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt / "step-4")
    tok = AutoTokenizer.from_pretrained(ckpt / "step-4")
    assert model.config.vocab_size == len(tok)
    assert sorted(p.name for p in (full_run / "final").iterdir()) == sorted(  # train.export_final: no ds/, trainer/
        p.name for p in (ckpt / "step-4").iterdir() if p.name not in ("ds", "trainer", "latest"))
    assert (full_run / "config.yaml").exists() and (full_run / "metrics.png").exists()
    samples = [json.loads(s) for s in (full_run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "reward"} <= set(samples[0])


def test_resume_reproduces_uninterrupted_run(full_run, tmp_path):
    """Simulate a crash right after the step-2 checkpoint, resume, compare steps 3-4."""
    crashed = tmp_path / "run"
    shutil.copytree(full_run, crashed, symlinks=True)
    shutil.rmtree(crashed / "checkpoints" / "step-4")
    (crashed / "checkpoints" / LATEST).unlink()
    (crashed / "checkpoints" / LATEST).write_text("step-2")  # the text-file form runs wrote before the symlink
    run_deepspeed(TINY_RUN + ["train.max_steps=4", "train.save_every=2", "algo.beta=0.04",
                              f"train.output_dir={crashed}", "--resume"])
    want = read_metrics(full_run / "metrics.jsonl")
    got = read_metrics(crashed / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # no step lost or duplicated
    for a, b in zip(want[2:], got[2:]):
        for key in ("reward/mean", "loss", "kl", "grad_norm", "completion/length_mean", "advantage/std"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    proc = run_deepspeed(TINY_RUN + [f"train.output_dir={tmp_path / 'empty'}", "--resume"], num_ranks=1, check=False)
    assert proc.returncode != 0
    assert "no checkpoint in" in proc.stderr + proc.stdout
