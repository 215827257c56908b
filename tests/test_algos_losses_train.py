"""Learning checks of the loss family: drgrpo, gspo, gtpo and grpo-s raise the reward of the
built-in digits task in a short 1-rank run. (Every algorithm's 2-rank run: tests/test_algos_train.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.training.metrics import read_metrics
from tests.conftest import run_deepspeed


def train(ranks: int, algo: str, out: Path, *overrides: str) -> list[dict]:
    run_deepspeed(["--algo", algo, "--config", "configs/demo.yaml", f"train.output_dir={out}",
                   "logging.progress_bar=false", "logging.plot=false", "reward_pool.num_workers=0", *overrides],
                  ranks, timeout=900)
    return read_metrics(out / "metrics.jsonl")


def mean_reward(rows: list[dict]) -> float:
    return sum(r["reward/mean"] for r in rows) / len(rows)


# gtpo / grpo-s count a completion as a success when r >= algo.success_threshold (default 1: exact).
# digits_match pays 0.5 for the right digit without EOS; exact answers are too rare for an untrained
# model to give the shaped rewards an outcome signal in a short run (measured over 40 steps: grpo-s
# stays at ~0.01, gtpo reaches ~0.2), so here the right digit counts as a success.
LEARN = {"drgrpo": [], "gspo": [], "gtpo": ["algo.success_threshold=0.5"], "grpo-s": ["algo.success_threshold=0.5"]}


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(LEARN))
def test_raises_the_reward_on_the_demo_task(algo: str, tmp_path: Path) -> None:
    """Copy one digit and stop ("4=" -> "4" EOS): the untrained model scores about 0.01."""
    rows = train(1, algo, tmp_path, "data.builtin.digits=1", "rollout.max_completion_length=2",
                 "train.lr=5e-3", "train.max_steps=30", "train.micro_batch_size=512", *LEARN[algo])
    first, last = mean_reward(rows[:5]), mean_reward(rows[-5:])
    assert last >= 0.2 and last >= 5 * first, f"{algo}: reward {first:.3f} -> {last:.3f}"
