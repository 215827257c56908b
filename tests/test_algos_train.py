"""Every algorithm trains the demo task for 3 steps on 2 DeepSpeed CPU ranks; dapo and gpg learn it.

Runs the real entry point (``deepspeed --num_gpus 2 train.py --algo NAME --config configs/demo.yaml``)
with a small batch, and checks the exit code, the metrics every algorithm must log
(ALGORITHMS.md, "What every algorithm must log") and each algorithm's own quantity.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DEEPSPEED = Path(sys.executable).with_name("deepspeed")

COMMON = ["train.max_steps=3", "logging.progress_bar=false", "logging.plot=false", "train.save_every=0",
          "rollout.prompts_per_step=4", "rollout.num_generations=4"]

# name -> (extra overrides, metrics that algorithm must log)
ALGOS = {
    "dapo": (["algo.overlong_buffer=1", "algo.overlong_filter=true", "algo.max_gen_batches=0"],
             ["dapo/kept_frac", "dapo/gen_batches", "dapo/reward_generated_mean", "reward/overlong/mean"]),
    "gpg": (["algo.threshold=0.6", "algo.max_gen_batches=3"], ["gpg/valid_group_frac", "gpg/gen_batches"]),
    "2-grpo": (["rollout.num_generations=2", "rollout.prompts_per_step=8"], []),
    "cppo": (["algo.beta=0.04", "algo.allocation=true"], ["cppo/kept_frac", "cppo/prompts", "kl"]),
    "prorl": (["algo.beta=0.001", "algo.reset_every=2", "algo.max_gen_batches=0"],
              ["prorl/ref_version", "prorl/reset", "kl", "dapo/kept_frac"]),
    "dcpo": ([], ["dcpo/times_sampled_mean"]),
    "edge-grpo": (["algo.guided_correction=true", "algo.solution_column=answer", "rollout.max_completion_length=8",
                   "algo.reflection_cue=' ?'"], ["edge/corrected_frac", "entropy"]),
}

EVERY_STEP = ["reward/mean", "reward/std", "reward/digits_match/mean", "advantage/mean", "advantage/std",
              "advantage/min", "advantage/max", "advantage/zero_group_frac", "completion/length_mean",
              "completion/length_max", "completion/truncated_frac"]
UPDATE = ["clip_frac_low", "clip_frac_high", "ratio_mean", "loss", "grad_norm"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(algo: str, out: Path, ranks: int, overrides: list[str], timeout: int = 600) -> list[dict]:
    cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(free_port()), "train.py", "--algo", algo,
           "--config", "configs/demo.yaml", f"train.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(ALGOS))
def test_trains_three_steps_on_two_ranks(algo, tmp_path):
    extra, own = ALGOS[algo]
    rows = launch(algo, tmp_path, 2, COMMON + extra)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in EVERY_STEP + own:
            assert r.get(key) is not None, f"{algo} did not log {key} at step {r['step']}"
        if not r.get("update_skipped"):
            for key in UPDATE:
                assert r.get(key) is not None, f"{algo} did not log {key} at step {r['step']}"
        else:
            assert algo == "gpg"
    if algo == "prorl":  # reset after step 2: the reference of step 3 is the policy of step 2
        assert [r["prorl/ref_version"] for r in rows] == [0, 0, 1]
        assert [r["prorl/reset"] for r in rows] == [0, 1, 0]
        assert (tmp_path / "reference" / "step-2" / "config.json").is_file()
    if algo == "cppo":
        assert all(r["cppo/kept_frac"] == 0.5 and r["cppo/prompts"] == 8 for r in rows)
    if algo == "dcpo":  # the per-prompt statistics are in the checkpoint, identical on both ranks
        states = [torch.load(tmp_path / "checkpoints" / "step-3" / "trainer" / f"rank{k}.pt", weights_only=False)
                  for k in range(2)]
        stats = states[0]["algo"]["prompt_stats"]
        assert len(stats) == 12 and stats == states[1]["algo"]["prompt_stats"]  # 3 steps x 4 prompts
    if algo == "gpg":
        assert all(r.get("gpg/alpha") is not None or r.get("update_skipped") for r in rows)


LEARN = ["data.builtin.digits=1", "rollout.max_completion_length=2", "train.lr=5e-3", "rollout.prompts_per_step=16",
         "rollout.num_generations=16", "logging.progress_bar=false", "logging.plot=false", "train.save_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize("algo,key,extra", [
    # dapo's logged reward/mean is that of the kept (mixed) groups; this one is the policy's, before filtering.
    # Stop before the policy is perfect: then no group has differing rewards and refilling cannot end.
    ("dapo", "dapo/reward_generated_mean", ["train.max_steps=60", "algo.max_gen_batches=30"]),
    ("gpg", "reward/mean", ["train.max_steps=80", "algo.threshold=0.6", "algo.max_gen_batches=5"]),
])
def test_learns_the_demo_task(algo, key, extra, tmp_path):
    """1-digit copy: the reward goes from about 0.01 to above 0.8."""
    rows = launch(algo, tmp_path, 1, LEARN + extra, timeout=900)
    first = sum(r[key] for r in rows[:10]) / 10
    last = sum(r[key] for r in rows[-10:]) / 10
    assert last >= 0.8 and last >= 5 * first, (first, last)
