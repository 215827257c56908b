"""Agents end to end: mt-grpo learns the calculator environment and gigpo the maze in short 1-rank runs
(the tiny model; the full runs are scripts/benchmarks/learn_agents.py). Both train on 2 DeepSpeed ranks in
tests/test_algos_train.py's launch (mt-grpo with its tool pool; gigpo's 5-turn maze under ZeRO-3, where the
ranks' trajectories have unequal token counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.training.configure import load_config

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["logging.progress_bar=false", "logging.plot=false", "train.save_every=0"]

# The short learning checks (kept in step with scripts/benchmarks/learn_agents.py, which runs the presets longer)
SHORT = {
    "mt-grpo": ["train.max_steps=50"],  # the preset's 500 steps cut short
    "gigpo": ["train.max_steps=25", "rollout.prompts_per_step=8", "rollout.num_generations=8", "train.lr=3e-3",
              "rollout.max_turns=4"],
}


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def risen(algo: str, history: list[dict]) -> bool:
    """The claim: the mean of the last 5 steps is above the first 5 by the margin (both metrics for mt-grpo)."""
    if len(history) < 10:
        return False
    ok = mean(history[-5:], "reward/mean") >= mean(history[:5], "reward/mean") + 0.3
    if algo == "mt-grpo":
        ok = ok and mean(history[-5:], "reward/exact/mean") >= mean(history[:5], "reward/exact/mean") + 0.05
    return ok


@pytest.mark.parametrize("algo", sorted(SHORT))
def test_short_learning_check(algo, single_rank_env, tmp_path):
    """mt-grpo: the calculator's reward (R^T + R^O, at most 2.2) rises by >= 0.3 and its exact-answer
    accuracy by >= 0.05 (the full run: scripts/benchmarks/learn_agents.py);
    gigpo: the maze's reward (+1 at the goal, -0.1 per invalid action) rises by >= 0.3.
    Steps run until the rise is shown (train.max_steps is the limit): the trainer's own step, then the
    algorithm's end-of-step hook, as its training loop runs them."""
    import torch

    from grpo.training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / f"{algo}.yaml", None, [f"train.output_dir={tmp_path}", *QUIET, *SHORT[algo]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as scripts/benchmarks/learn_agents.py: two threads on a busy 2-core machine spin 5-10x slower
    trainer, history = Trainer(cfg), []
    try:
        while trainer.step < cfg.train.max_steps and not risen(algo, history):
            metrics = trainer.train_step()
            trainer.step += 1
            trainer.algo.on_step_end(trainer.context(), metrics)
            history.append(metrics)
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    first, last = mean(history[:5], "reward/mean"), mean(history[-5:], "reward/mean")
    assert risen(algo, history), f"{algo}: reward {first:.3f} -> {last:.3f} in {len(history)} steps"
