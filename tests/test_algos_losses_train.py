"""Learning checks of the loss family: drgrpo, gspo, gtpo, grpo-s and peers' algorithms raise the reward of the
built-in digits task in a short 1-rank run. (Every algorithm's 2-rank run: tests/test_algos_train.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.training.metrics import read_metrics
from tests.conftest import run_deepspeed


def mean_reward(rows: list[dict]) -> float:
    return sum(r["reward/mean"] for r in rows) / len(rows)


# gtpo / grpo-s count a completion as a success when r >= algo.success_threshold (default 1: exact).
# digits_match pays 0.5 for the right digit without EOS; exact answers are too rare for an untrained
# model to give the shaped rewards an outcome signal in a short run (measured over 40 steps: grpo-s
# stays at ~0.01, gtpo reaches ~0.2), so here the right digit counts as a success.
LEARN = {"grpo": ["algo.beta=0"],  # 0.011 -> 0.365 measured (no reference: the KL term has its own tests)
         "drgrpo": [], "gspo": [], "gtpo": ["algo.success_threshold=0.5"], "grpo-s": ["algo.success_threshold=0.5"],
         # the peers' (tests/test_algos_peers.py): TRL's cispo and sapo, verl's rloo, optimal-token-baseline and dro
         "cispo": [], "sapo": [], "rloo": [], "optimal-token-baseline": [],
         "dro": ["algo.dro_beta=0.1", "algo.num_iterations=2"]}


# Copy one digit and stop ("4=" -> "4" EOS): the untrained model scores about 0.01. A run stops as soon as the
# claim below can hold (train.stop_when: the last 5 steps' mean reward >= 0.2, from step 10 on), at 30 steps at most.
TASK = ["data.builtin.digits=1", "rollout.max_completion_length=2", "train.lr=5e-3", "train.micro_batch_size=512",
        "reward_pool.num_workers=0", "train.stop_when={at_least: 0.2, window: 5, min_steps: 10}"]


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory) -> Path:
    """Every algorithm of LEARN for up to 30 steps on 1 rank, one after the other in one launch (the launch costs
    more than a run: tests/algo_smoke_worker.py)."""
    out = tmp_path_factory.mktemp("learn")
    plan = out / "plan.json"
    plan.write_text(json.dumps({name: TASK + extra for name, extra in LEARN.items()}))
    run_deepspeed(["--plan", str(plan), "--out", str(out), "--steps", "30"], 1, "tests/algo_smoke_worker.py")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(LEARN))
def test_raises_the_reward_on_the_demo_task(algo: str, learning_runs: Path) -> None:
    status = json.loads((learning_runs / algo / "status.json").read_text())
    assert status["ok"], status.get("traceback", status)
    rows = read_metrics(learning_runs / algo / "metrics.jsonl")
    assert 10 <= len(rows) <= 30  # the first and the last 5 steps do not overlap
    first, last = mean_reward(rows[:5]), mean_reward(rows[-5:])
    assert last >= 0.2 and last >= 5 * first, f"{algo}: reward {first:.3f} -> {last:.3f}"
