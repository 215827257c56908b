"""Runs that learn nothing without saying so, and steps that would poison the weights.

``LearningHealth`` warns once per cause, loudly and with the fix, when for ``patience`` steps in a row
    - more than 90% of the completions are truncated (no EOS within rollout.max_completion_length),
    - a reward source fails (raises or times out) on more than half of its rows: reward errors, not a hard task,
    - more than 95% of the groups have all-equal rewards (every advantage of the group is 0) while the
      rewards themselves work: the task is too hard or too easy,
    - the gradient norm is 0,
    - the engine's log-probs of its own tokens are more than 0.1 nats per token from the trainer's (a stale or
      mismatched sampler);
``logging.health_skip`` names the checks a run expects to fail (said at its start).
``NonFiniteWatchdog`` counts steps whose loss or gradient norm is not finite (their update is
skipped) and stops the run after ``limit`` of them in a row, naming the step and the likely causes;
no checkpoint ever holds weights from a skipped update.
``RewardFailureGuard`` stops the run when a reward source fails on more than half of its rows for
``reward_pool.max_failing_steps`` steps in a row, with the source's own error and a guess at the fix.
``together(fn)`` raises an outside service's failure on every rank at once; ``stop_reached`` decides
``train.stop_when``.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Optional

import torch

from grpo.foundation.console import say
from grpo.foundation import dist
from grpo.foundation.config import HEALTH_CHECKS, Config, ConfigError
from grpo.foundation.plugins import RewardServiceError
from grpo.reference.protocol import ReferenceServerError

SAMPLER_GAP_WARN = 0.1  # nats per token: 2-5x bf16 kernels' mean gap on a GPU (0.02-0.04, docs/results.md)


def reward_failed_frac(m: dict[str, float]) -> float:
    """The largest share of rows any reward source failed on (errors + timeouts) this step."""
    return max((v for k, v in m.items() if k.startswith("reward/") and k.endswith("/failed_frac")), default=0.0)


CHECKS = {
    "reward_errors": (
        lambda m: reward_failed_frac(m) > 0.5,
        "a reward function fails (raises or times out) on more than half of its rows (reward/<name>/errors and "
        "/timeouts in metrics.jsonl): the rewards are broken, not the task. Its first traceback is in the log; "
        "see docs/rewards.md for the call signature.",
    ),
    "truncation": (
        lambda m: m.get("completion/truncated_frac", 0.0) > 0.9,
        "more than 90% of the completions hit rollout.max_completion_length={L} without EOS: their "
        "rewards see cut-off answers{filtered}. Raise rollout.max_completion_length or ask for shorter answers in "
        "the prompt (a policy that has not learned to stop yet, where the cap fits the answer, passes this once it "
        "has).",
    ),
    "zero_advantage": (
        lambda m: m.get("advantage/zero_group_frac", 0.0) > 0.95 and reward_failed_frac(m) <= 0.5,
        "more than 95% of the groups have all-equal rewards, so their advantages are 0 and they teach "
        "nothing: the task is too hard or too easy for the policy, or the reward too coarse. Raise "
        "rollout.num_generations={G}, use a partial-credit reward, or use dynamic sampling (--algo dapo).",
    ),
    "sampler_mismatch": (
        lambda m: m.get("sampler_gap/mean", 0.0) > SAMPLER_GAP_WARN,
        "the generation engine's log-probs of its own tokens differ from the trainer's by more than "
        f"{SAMPLER_GAP_WARN} nats per token on average (sampler_gap/mean; rollout_corr/k1 and /k3 with "
        "algo.rollout_correction): the likely causes are stale weights (the engine missed a weight sync: "
        "rollout.engine={engine}), lower-precision kernels (bf16 / fp16 sampling against an fp32 trainer), or "
        "top-k / top-p truncation (the sampler's log-probs are of the filtered distribution; rollout.top_k=0 and "
        "rollout.top_p=1 show the kernels alone). algo.rollout_correction corrects or masks the affected tokens.",
    ),
    "zero_gradient": (
        lambda m: m.get("grad_norm", 1.0) == 0.0,
        "the gradient norm is 0: nothing is being learned (all advantages 0, every token masked, or "
        "train.lr={lr} with frozen weights). Check the reward terms in metrics.jsonl.",
    ),
}


assert tuple(CHECKS) == HEALTH_CHECKS, "config.py's HEALTH_CHECKS names these checks"


class LearningHealth:
    def __init__(self, cfg: Config, patience: int, main: bool):
        self.cfg, self.patience, self.main = cfg, patience, main
        self.streak = {name: 0 for name in CHECKS}
        # logging.health_skip: checks the run expects to fail (said once, at the start)
        self.warned: set[str] = set(cfg.logging.health_skip)
        if self.warned and main:
            say(f"logging.health_skip: no warning for {', '.join(sorted(self.warned))} in this run")

    def check(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Update the streaks with one step's (rank-reduced) metrics; returns the warnings given now."""
        given = []
        for name, (bad, text) in CHECKS.items():
            self.streak[name] = self.streak[name] + 1 if bad(metrics) else 0
            if self.streak[name] >= self.patience and name not in self.warned:
                self.warned.add(name)
                r = self.cfg.rollout
                filtered = (" and algo.overlong_filter drops them from the loss"
                            if getattr(self.cfg.algo.options, "overlong_filter", False) else "")
                msg = (f"WARNING (step {step}, {self.patience} steps in a row): "
                       + text.format(L=r.max_completion_length, G=r.num_generations, lr=self.cfg.train.lr,
                                     engine=r.engine, filtered=filtered))
                given.append(msg)
                if self.main:
                    say(msg, err=True)
        return given


class TrainingStopped(RuntimeError):
    """The watchdog stopped the run; the message names the step and the likely causes."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped after its step in progress, which was saved (``checkpoint``: its folder)."""

    def __init__(self, step: int, checkpoint: Any):
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint = step, checkpoint


class CtrlC:
    """The first Ctrl-C (SIGINT) asks the run to stop after the step in progress (``requested``: the trainer saves
    it then, as a finished step); a second one stops at once (KeyboardInterrupt, the step in progress lost).
    Installed only in the main thread (a signal handler can be nowhere else), and restored on exit."""

    def __init__(self):
        self.requested, self._old = False, None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        say("\nCtrl-C: stopping after this step, which will be saved (Ctrl-C again to stop at once)", err=True)

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


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


class RewardsFailing(TrainingStopped):
    """A reward source failed on most rows several steps in a row; the message holds its error and the fix."""


class RewardFailureGuard:
    """Counts, per reward source, the steps in a row on which it failed on more than half of its rows (from the
    rank-reduced ``reward/<name>/failed_frac``, so every rank decides alike) and stops the run at ``limit``."""

    def __init__(self, limit: int, threshold: float = 0.5):
        self.limit, self.threshold = limit, threshold
        self.streak: dict[str, int] = {}

    def check(self, step: int, metrics: dict[str, float], rewards) -> None:
        for key, frac in metrics.items():
            if not (key.startswith("reward/") and key.endswith("/failed_frac")):
                continue
            name = key[len("reward/"):-len("/failed_frac")]
            self.streak[name] = self.streak.get(name, 0) + 1 if frac > self.threshold else 0
            if self.streak[name] >= self.limit:
                report = rewards.failure_report(name) if name in rewards.first_error else (
                    "(the error happened on another rank: see that rank's log)")
                raise RewardsFailing(
                    f"step {step}: reward {name!r} failed on {frac:.0%} of its rows, {self.streak[name]} steps in a "
                    f"row (reward_pool.max_failing_steps={self.limit}); its rows would score 0 and nothing would "
                    f"be learned. Its first error:\n{report}"
                )


def together(fn: Callable[[], Any]) -> Any:
    """``fn()``, where a failure of an outside service (the reference server, a reward server or endpoint) on
    any rank is raised on every rank at this one point: the ranks leave the step together, before its
    training passes, and can save a checkpoint together (the trainer's loop)."""
    failed, out = None, None
    try:
        out = fn()
    except (ReferenceServerError, RewardServiceError) as e:
        failed = e
    code = 0.0 if failed is None else 1.0 if isinstance(failed, ReferenceServerError) else 2.0
    worst = code
    if dist.is_initialized() and dist.world_size() > 1:
        worst = float(dist.all_reduce_max(torch.tensor([code], dtype=torch.float64))[0])
    if failed is not None:
        raise failed
    if worst == 1.0:
        raise ReferenceServerError("another rank could not reach the reference server (its error is in that "
                                   "rank's output)")
    if worst == 2.0:
        raise RewardServiceError("another rank's reward service failed (its error is in that rank's output)")
    return out


class AgreedRollout:
    """The rollout service as the algorithm's hooks see it (``ctx.rollout``): its scoring, the outside service a hook
    calls (remax's greedy baseline, edge-grpo's rewritten rows), goes through :func:`together`, so one rank's
    failure is raised on every rank right there, before the hook's next collective (a hook calls these on every
    rank, as it calls ``generate``). Everything else is the service's own."""

    def __init__(self, service: Any):
        object.__setattr__(self, "_service", service)

    def score(self, batch: Any) -> None:
        together(lambda: self._service.score(batch))

    def rewrite(self, batch: Any, rows: list[int], completions: list) -> None:
        together(lambda: self._service.rewrite(batch, rows, completions))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._service, name, value)


def stop_reached(cfg: Config, step: int, history: list[dict], evaluator: Optional[Any]) -> bool:
    """``train.stop_when``: whether the mean of its metric over the last ``window`` steps of this run reached
    ``at_least``. Decided on rank 0 and shared, so every rank leaves the loop after the same step; a metric
    the steps do not log stops the run with the names they do log."""
    sw = cfg.train.stop_when
    if dist.any_rank(sw.metric not in history[-1]):
        if evaluator is not None and sw.metric.startswith("eval/") and not evaluator.due(step):
            return False  # an evaluation's metric: decided at the steps that evaluate (eval.every)
        known = sorted(k for k, v in history[-1].items() if isinstance(v, (int, float)) and k != "step")
        raise ConfigError(f"train.stop_when.metric={sw.metric!r} is not logged by this run's steps; choose "
                          f"from {known}")
    window = [h[sw.metric] for h in history if sw.metric in h][-sw.window:]  # the last `window` times logged
    mean = sum(window) / len(window)
    reached = dist.any_rank(dist.is_main() and len(window) == sw.window and step >= sw.min_steps
                            and mean >= sw.at_least)
    if reached and dist.is_main():
        say(f"train.stop_when: the mean of {sw.metric} over the last {sw.window} steps is {mean:.4g} >= "
            f"{sw.at_least:g} at step {step}: stopping before train.max_steps={cfg.train.max_steps}")
    return reached
