"""Every registered algorithm trains the demo task for a few steps on 2 CPU ranks.

One deepspeed launch runs them all in turn (tests/algo_smoke_worker.py); this test is
parametrised over the registry and checks each algorithm's status and metrics.
"""

from __future__ import annotations

import json
import math

import pytest

from algos import ALGORITHMS
from grpo.metrics import read_metrics
from tests.conftest import run_deepspeed

pytestmark = pytest.mark.slow
NAMES = sorted(ALGORITHMS)
CLIP = ["clip_frac_low", "clip_frac_high", "ratio_mean"]
# what each must log besides the trainer's reward / advantage / length metrics (ALGORITHMS.md)
LOGGED = {
    "grpo": CLIP + ["kl"],
    "drgrpo": CLIP,
    "gtpo": CLIP + ["entropy", "gtpo/success_frac", "gtpo/shaped_reward_pos", "gtpo/shaped_reward_neg"],
    "grpo-s": CLIP + ["entropy", "grpo_s/success_frac", "grpo_s/shaped_reward"],
    "gspo": CLIP,
    "gspo-token": CLIP,
    "tic-grpo": CLIP,
    "pspo": ["ratio_mean", "smoothed_ratio_mean"],
    "lambda-grpo": CLIP + ["prefix_count_mean"],
    "grpo-lambda": CLIP,
    "grpo-lead": CLIP + ["grpo_lead/shaped_reward", "grpo_lead/correct_frac"],
    "diver": CLIP + ["diver/bonus", "diver/bonus_correct"],
    "grpo-ps": CLIP + ["grpo_ps/step_reward", "grpo_ps/steps_per_completion"],
}
COMMON = ["reward/mean", "reward/std", "advantage/mean", "advantage/std", "advantage/min", "advantage/max",
          "advantage/zero_group_frac", "completion/length_mean", "completion/length_max",
          "completion/truncated_frac", "loss", "grad_norm", "lr"]
SMALL = ["rollout.prompts_per_step=4", "rollout.num_generations=4", "train.micro_batch_size=6"]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("algos")
    run_deepspeed(["--algos", ",".join(NAMES), "--out", str(out), *SMALL], 2, "tests/algo_smoke_worker.py",
                  timeout=900)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_trains_on_two_ranks(smoke_runs, name):
    status = json.loads((smoke_runs / name / "status.json").read_text())
    assert status["ok"], status.get("traceback", status)
    rows = read_metrics(smoke_runs / name / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        missing = [k for k in COMMON + LOGGED.get(name, CLIP) if k not in r]
        assert not missing, f"{name} did not log {missing}"
        assert all(math.isfinite(r[k]) for k in COMMON + LOGGED.get(name, CLIP)), r
    assert (smoke_runs / name / "checkpoints" / "latest").exists()
