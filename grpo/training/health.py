"""Runs that learn nothing without saying so, and steps that would poison the weights.

``LearningHealth`` warns once per cause, loudly and with the fix, when for ``patience`` steps in a row
    - more than 90% of the completions are truncated (no EOS within rollout.max_completion_length),
    - more than 95% of the groups have all-equal rewards (every advantage of the group is 0),
    - the gradient norm is 0.
``NonFiniteWatchdog`` counts steps whose loss or gradient norm is not finite (their update is
skipped) and stops the run after ``limit`` of them in a row, naming the step and the likely causes;
no checkpoint ever holds weights from a skipped update.
"""

from __future__ import annotations

import sys

from grpo.foundation.config import Config

CHECKS = {
    "truncation": (
        lambda m: m.get("completion/truncated_frac", 0.0) > 0.9,
        "more than 90% of the completions hit rollout.max_completion_length={L} without EOS: their "
        "rewards (and DAPO's overlong filter) see cut-off answers. Raise rollout.max_completion_length "
        "or ask for shorter answers in the prompt.",
    ),
    "zero_advantage": (
        lambda m: m.get("advantage/zero_group_frac", 0.0) > 0.95,
        "more than 95% of the groups have all-equal rewards, so their advantages are 0 and they teach "
        "nothing: the task is too hard or too easy for the policy, or the reward too coarse. Raise "
        "rollout.num_generations={G}, use a partial-credit reward, or use dynamic sampling (--algo dapo).",
    ),
    "zero_gradient": (
        lambda m: m.get("grad_norm", 1.0) == 0.0,
        "the gradient norm is 0: nothing is being learned (all advantages 0, every token masked, or "
        "train.lr={lr} with frozen weights). Check the reward terms in metrics.jsonl.",
    ),
}


class LearningHealth:
    def __init__(self, cfg: Config, patience: int, main: bool):
        self.cfg, self.patience, self.main = cfg, patience, main
        self.streak = {name: 0 for name in CHECKS}
        self.warned: set[str] = set()

    def check(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Update the streaks with one step's (rank-reduced) metrics; returns the warnings given now."""
        given = []
        for name, (bad, text) in CHECKS.items():
            self.streak[name] = self.streak[name] + 1 if bad(metrics) else 0
            if self.streak[name] >= self.patience and name not in self.warned:
                self.warned.add(name)
                r = self.cfg.rollout
                msg = (f"WARNING (step {step}, {self.patience} steps in a row): "
                       + text.format(L=r.max_completion_length, G=r.num_generations, lr=self.cfg.train.lr))
                given.append(msg)
                if self.main:
                    print(msg, file=sys.stderr, flush=True)
        return given


class TrainingStopped(RuntimeError):
    """The watchdog stopped the run; the message names the step and the likely causes."""


class NonFiniteWatchdog:
    def __init__(self, cfg: Config, limit: int):
        self.cfg, self.limit = cfg, limit
        self.in_a_row = 0
        self.total = 0

    def record(self, step: int, finite: bool, loss: float, grad_norm: float) -> None:
        """After each step: raise TrainingStopped after ``limit`` non-finite steps in a row."""
        if finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            t, a = self.cfg.train, self.cfg.algo
            raise TrainingStopped(
                f"step {step}: {self.in_a_row} steps in a row had a non-finite loss ({loss}) or gradient norm "
                f"({grad_norm}); their updates were skipped, so the weights and the last checkpoint are those "
                f"of the last good step. Likely causes: a learning rate too high (train.lr={t.lr}), fp16 overflow "
                f"(model.dtype={self.cfg.model.dtype}; bf16 has fp32's range), a KL term blowing up "
                f"(algo.beta={a.beta}, algo.kl_estimator={a.kl_estimator}), or ratios exploding over "
                f"algo.num_iterations={a.num_iterations} passes. Lower train.lr, or resume from the last "
                f"checkpoint with --resume after changing the setting (train.max_nonfinite_steps={self.limit})."
            )
