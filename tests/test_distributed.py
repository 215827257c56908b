"""Multi-process integration: the DeepSpeed launcher with CPU ranks, the real trainer.

- the gradient of one step does not depend on ranks, micro-batch size or ZeRO stage;
- the trainer on 2 launched ranks (full fine-tuning, and LoRA under ZeRO-2) writes metrics and a loadable
  checkpoint; --resume continues exactly as the uninterrupted run (the runs and their resumes share one launch:
  tests/algo_smoke_worker.py, ``crash_of``); --resume without a checkpoint is refused at start;
- two simulated nodes of one rank each (the deepspeed launcher with a hostfile, no ssh) give the metrics of one
  node with two ranks, bit for bit;
- reward rises on the built-in task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from grpo.training.checkpoint import LATEST
from grpo.training.metrics import read_metrics
from grpo.foundation.dist import free_port
from tests.conftest import ROOT, run_deepspeed
from tests.dist_grad_worker import per_aggregation, run_cases
from tests.patience import LAUNCH_S

pytestmark = pytest.mark.slow

TINY_RUN = ["--config", "configs/demo.yaml", "logging.progress_bar=false", "rollout.prompts_per_step=4",
            "rollout.num_generations=4", "train.micro_batch_size=5", "logging.log_every=1"]


@pytest.mark.parametrize("other", ["w2-mb3-z0", "w2-mb5-z2", "w2-mb5-z3", "w2-tok12-z3", "w2-mb5-z3-built-partitioned",
                                   "w2-mb3-z2+lora", "w2-mb5-z3-moe"])
def test_step_gradient_independent_of_ranks_and_micro_batches(grads, other):
    """With ``+lora`` the policy has LoRA adapters (B made non-zero) and the gradient is the adapters' (small) one:
    2 ranks x micro-batches of 3 under ZeRO-2 against 1 rank x 1 micro-batch. ``-moe``: a tiny Qwen3-MoE (top-2
    of 4 experts) saved per expert as transformers saves it, built partitioned (each fused expert weight filled from
    its experts' tensors), its MoE blocks ZeRO-3 leaves, against the same model on one rank."""
    lora = other.endswith("+lora")
    ref = grads["w1-mb16-z0+lora" if lora else "w1-mb16-z0-moe" if other.endswith("-moe") else "w1-mb16-z0"]
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


def test_zero3_generation_and_evaluation_stay_in_step(grads):
    """Under ZeRO-3 (weights partitioned) ranks with unequal generation work neither hang nor differ; models
    built partitioned hold the whole model's weights, the partitioned reference answers like it, and it is
    synced (mixed, reloaded) by the formula (tests/zero3_generate_worker.py, run after the gradient cases)."""
    checks = json.loads(grads["zero3_checks"].read_text())
    assert len(checks) == 21, checks
    assert all(checks.values()), [k for k, ok in checks.items() if not ok]


# LoRA on 2 ranks, ZeRO-2, beta > 0 with the free reference (adapters off), a checkpoint every 2 steps
LORA_RUN = ["train.zero_stage=2", "algo.beta=0.04", "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, "
            "up_proj], modules_to_save: [lm_head]}", "train.lr=3e-3", "train.max_steps=4", "train.save_every=2"]
FULL_RUN = ["train.max_steps=4", "train.save_every=2", "algo.beta=0.04"]
# the static engine under ZeRO-3 (rides in the full runs' launch; not resumed)
STATIC_RUN = ["algo.beta=0", "rollout.engine=static", "algo.tis_cap=2.0", "train.zero_stage=3", "model.dtype=fp32",
              "train.max_steps=2"]
# streamed rollouts (rollout.max_staleness=1) on 2 ranks under ZeRO-2, each rank its own slots and share of the data
STREAM_RUN = ["algo.beta=0", "rollout.engine=static", "rollout.max_staleness=1", "algo.rollout_correction={mode: "
              "truncate}", "train.zero_stage=2", "model.dtype=fp32", "train.max_steps=3", "rollout.slots=64"]


# two nodes against one node with two ranks (test_two_nodes_equal_two_ranks_on_one_node): the same overrides
MULTINODE_RUN = ["algo.beta=0", "train.max_steps=3", "reward_pool.num_workers=0", "train.save_every=0",
                 "logging.plot=false"]


def run_overrides(over: list[str], folder: Path) -> list[str]:
    """A run's overrides on configs/demo.yaml: TINY_RUN's, then ``over``, which win."""
    return [*TINY_RUN[2:], "logging.plot=true", *over, f"train.output_dir={folder}"]


def write_plan(path: Path, runs: dict[str, tuple[list[str], Path, Optional[dict]]]) -> Path:
    """A tests/algo_smoke_worker.py plan of several train runs, in order: name -> (overrides on TINY_RUN's, output
    folder, None or how it starts as an earlier run crashed: ``crash_of``, resumed with --resume)."""
    plan = {name: {"algo": None, "resume": crash is not None, "overrides": run_overrides(over, folder)}
            for name, (over, folder, crash) in runs.items()}
    for name, (_, _, crash) in runs.items():
        if crash is not None:
            plan[name]["crash_of"] = crash
    path.write_text(json.dumps(plan))
    return path


GRAD_CASES = ["w2-mb3-z0:3:0", "w2-mb5-z2:5:2", "w2-mb5-z3:5:3", "w2-tok12-z3:16/12:3", "w2-mb5-z3-built-partitioned:5:3",
              "w2-mb3-z2+lora:3:2", "w2-mb5-z3-moe:5:3"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory, tiny_dir, single_rank_env) -> dict:
    """The file's one 2-rank launch (tests/dist_grad_worker.py; each launch costs the ranks' start-up), in order:

    - the train runs: the two-rank side of the two-node comparison (``one-node``, first: a fresh process, as
      train.py's); the uninterrupted runs, 4 steps with a checkpoint every 2 steps, full fine-tuning (``full``)
      and LoRA under ZeRO-2 (``lora``), 2 steps with the static engine under ZeRO-3 (``static``), 3 streamed
      steps under ZeRO-2 (``stream``); then
      ``full`` and ``lora`` as if each had crashed right after its step-2 checkpoint (``full`` with the text-file
      ``latest`` runs wrote before the symlink), resumed with --resume (``resumed-full``, ``resumed-lora``);
    - the step-gradient cases (GRAD_CASES; built-partitioned: the same weights from an HF folder, built
      partitioned from the start with zero.Init; NAME+lora: the LoRA adapters' gradient; NAME-moe: a tiny
      Qwen3-MoE from its folder);
    - tests/zero3_generate_worker.py's checks (test_zero3_generation_...).

    The one-rank reference gradients are computed in this process (a world of one: no launch)."""
    from grpo.foundation.tiny import write_tiny

    out = tmp_path_factory.mktemp("dist")
    builtin = "builtin:tiny-char"
    moe = write_tiny(out / "moe", arch="qwen3_moe")
    w1 = run_cases([f"w1-mb16-z0:16:0:{builtin}", "w1-mb16-z0+lora:16:0", f"w1-mb16-z0-moe:16:0:{moe}"], builtin, out)
    runs = {"one-node": (MULTINODE_RUN, out / "one-node", None), "full": (FULL_RUN, out / "run", None),
            "lora": (LORA_RUN, out / "lora", None), "static": (STATIC_RUN, out / "static", None),
            "stream": (STREAM_RUN, out / "stream", None)}
    for k in ("full", "lora"):
        runs[f"resumed-{k}"] = (runs[k][0], out / "resumed" / k,
                                {"run": str(runs[k][1]), "step": 2, "text_latest": k == "full"})
    cases = [f"{c}:{tiny_dir}" if "built-partitioned" in c else f"{c}:{moe}" if c.endswith("-moe:5:3") else c
             for c in GRAD_CASES]
    run_deepspeed(["--plan", str(write_plan(out / "plan.json", runs)), str(out / "status"), "--out", str(out / "w2.pt"),
                   *[a for c in cases for a in ("--case", c)], "--zero3-checks", str(tiny_dir), str(out / "zero3_checks.json")],
                  2, "tests/dist_grad_worker.py", launcher="torchrun")
    statuses = {name: json.loads((out / "status" / name / "status.json").read_text()) for name in runs}
    for status in statuses.values():
        assert status["ok"], status.get("traceback", status)
    # the crashed copies were picked up at their step-2 checkpoint, the others started anew
    assert {k: s["start_step"] for k, s in statuses.items()} == {"one-node": 0, "full": 0, "lora": 0, "static": 0,
                                                                 "stream": 0, "resumed-full": 2, "resumed-lora": 2}
    return {"runs": {k: folder for k, (_, folder, _) in runs.items()},
            "grads": {**w1, **torch.load(out / "w2.pt"), "zero3_checks": out / "zero3_checks.json"}}


@pytest.fixture(scope="module")
def grads(launch) -> dict:
    return launch["grads"]


@pytest.fixture(scope="module")
def launched(launch) -> dict[str, Path]:
    return launch["runs"]


@pytest.fixture(scope="module")
def full_runs(launched) -> dict[str, Path]:
    return {k: launched[k] for k in ("full", "lora", "static", "stream")}


@pytest.fixture(scope="module")
def full_run(full_runs) -> Path:
    return full_runs["full"]


@pytest.fixture(scope="module")
def resumed_runs(launched) -> dict[str, Path]:
    """Each full run crashed after step 2 and resumed with --resume (in the same launch)."""
    return {k: launched[f"resumed-{k}"] for k in ("full", "lora")}


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


def test_resume_reproduces_uninterrupted_run(full_runs, resumed_runs):
    """A crash right after the step-2 checkpoint, resumed: steps 3-4 as in the uninterrupted run."""
    want = read_metrics(full_runs["full"] / "metrics.jsonl")
    got = read_metrics(resumed_runs["full"] / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # no step lost or duplicated
    for a, b in zip(want[2:], got[2:]):
        for key in ("reward/mean", "loss", "kl", "grad_norm", "completion/length_mean", "advantage/std"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_lora_two_ranks_zero2_free_reference_checkpoint_and_resume(full_runs, resumed_runs):
    """LoRA on 2 ranks, ZeRO-2, beta > 0 with the free reference: the run writes adapter checkpoints (partitioned
    optimizer state without the frozen base), and --resume from step 2 reproduces steps 3-4."""
    ckpt = full_runs["lora"] / "checkpoints" / "step-4"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    shards = sorted((ckpt / "ds").glob("*optim_states.pt"))
    assert len(shards) == 2  # ZeRO-2: each rank's partition of the adapters' optimizer state
    want = read_metrics(full_runs["lora"] / "metrics.jsonl")
    got = read_metrics(resumed_runs["lora"] / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4] and want[-1]["kl"] > 0
    for a, b in zip(want[2:], got[2:]):
        for key in ("reward/mean", "loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_two_ranks_under_zero3_train_with_the_static_engine(full_runs):
    """ZeRO-3 over 2 CPU ranks: each generation call gathers the weights once on every rank (a collective, also on
    a rank without prompts), then decodes with no collectives; the sampler's log-probs match the trainer's."""
    rows = read_metrics(full_runs["static"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sampler_gap/max"] < 1e-4 for r in rows)


def test_two_ranks_stream_their_rollouts_within_the_bound(full_runs):
    """rollout.max_staleness=1 over 2 CPU ranks (ZeRO-2): each rank streams its share of the data through its own
    slots and ends its step with its share of whole groups; the ranks' training passes stay in step, and no trained
    token is more than one step behind."""
    rows = read_metrics(full_runs["stream"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1 and torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert any(r["rollout/staleness_mean"] > 0 for r in rows)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    """In-process: the refusal comes from the start-up checks, before DeepSpeed or a model (no launch needed)."""
    import train

    assert train.main(TINY_RUN + [f"train.output_dir={tmp_path / 'empty'}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: no checkpoint in" in err and "start without --resume" in err, err


def is_timing(key: str) -> bool:
    """Wall-clock metrics differ between any two runs: the time/* phases, throughput, reward latencies."""
    return key.startswith(("time/", "tokens_per_sec")) or key.endswith("/latency")


def run_two_nodes(args: list[str], script: str, tmp: Path) -> None:
    hostfile = tmp / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")  # two names for this machine: two "nodes"
    exe = Path(sys.executable).with_name("deepspeed")
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # torchrun's default for the one-node side
    procs = [subprocess.Popen([str(exe), "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank",
                               str(node), "--master_addr", "127.0.0.1", "--master_port", port, script, *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=LAUNCH_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}\n{out[-5000:]}"


def test_two_nodes_equal_two_ranks_on_one_node(launched, tmp_path):
    """More than one node: two simulated nodes of one CPU rank each on loopback, launched the way a cluster without
    ssh is (`deepspeed --hostfile H --no_ssh --num_nodes 2 --node_rank N --master_addr A`), give the same metrics
    as one node with two ranks (the ``one-node`` run of the shared launch, the same overrides), bit for bit (loss
    and grad_norm included, so the same step gradient)."""
    run_two_nodes(["--config", "configs/demo.yaml", *run_overrides(MULTINODE_RUN, tmp_path / "nodes")], "train.py",
                  tmp_path)
    nodes, ranks = read_metrics(tmp_path / "nodes" / "metrics.jsonl"), read_metrics(launched["one-node"] / "metrics.jsonl")
    assert len(nodes) == len(ranks) == 3
    for a, b in zip(nodes, ranks):
        assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
    # one writer: rank 0 of node 0 wrote the checkpoint and the metrics, once
    assert (tmp_path / "nodes" / "checkpoints" / "step-3" / "config.json").is_file()
