"""Reward functions: the protocol, the registry, and weighted combination.

A reward function is ``fn(prompts, completions, **columns) -> list[float]``: ``prompts``
and ``completions`` are decoded texts (one entry per completion, prompts repeated for
each member of a group), ``columns`` are the dataset's columns aligned the same way,
and the spec's ``kwargs`` are passed as keyword arguments too.

Custom functions are named by import path in the YAML (the module must be importable,
e.g. from the working directory or an installed package)::

    rewards:
      - fn: math_correct
      - fn: mypkg.myrewards:brevity      # def brevity(prompts, completions, **columns) -> list[float]
        weight: 0.5
        kwargs: {max_words: 50}

Calls run in worker processes (rewards/pool.py, ``reward_pool`` in the config): a call
that raises scores 0 and logs its traceback (the first one of each function only); a
call past ``reward_pool.timeout`` scores 0; both are counted in the step's metrics.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from grpo.foundation.config import ConfigError, RewardPoolConfig, RewardSpec
from rewards.countdown import countdown
from rewards.digits import digits_match, digits_step_match
from rewards.format import format_soft, format_strict
from rewards.math_answer import math_correct
from rewards.pool import Call, WorkerPool

log = logging.getLogger("rewards")


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]: ...


class StepRewardFn(Protocol):
    """Process supervision (grpo-ps): one score per reasoning step of one completion."""

    def __call__(self, prompt: str, steps: list[str], example: dict[str, Any]) -> list[float]: ...


REGISTRY: dict[str, RewardFn] = {
    "digits_match": digits_match,
    "math_correct": math_correct,
    "format_strict": format_strict,
    "format_soft": format_soft,
    "countdown": countdown,
}

STEP_REGISTRY: dict[str, StepRewardFn] = {
    "digits_step_match": digits_step_match,
}


def resolve(name: str, registry: Optional[dict[str, Callable]] = None, key: str = "rewards fn") -> Callable:
    """A registered name (in ``registry``, default the outcome rewards), or ``package.module:function``;
    ``key`` names the config key in errors."""
    registry = REGISTRY if registry is None else registry
    if name in registry:
        return registry[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{key}={name!r} cannot be imported: {e}") from e
        if not callable(fn):
            raise ConfigError(f"{key}={name!r} is not callable")
        return fn
    raise ConfigError(
        f"{key}={name!r} is unknown: choose from {sorted(registry)} or give 'package.module:function'"
    )


@dataclass
class RewardTerm:
    name: str
    fn: Callable[..., list[float]]
    spec: str  # what the workers resolve
    weight: float
    kwargs: dict


class CombinedReward:
    """Weighted sum of several reward functions; each one's values are kept for logging.

    Each function is called on chunks of ``pool.chunk_size`` rows in the worker pool; a chunk
    that raises or times out scores 0 for its rows, which are counted per function
    (``pop_metrics``: ``reward/<name>/errors`` and ``reward/<name>/timeouts``).
    """

    def __init__(self, specs: list[RewardSpec], pool: Optional[RewardPoolConfig] = None):
        self.pool_cfg = pool or RewardPoolConfig()
        self.terms = []
        seen: dict[str, int] = {}
        for spec in specs:
            base = spec.fn.split(":")[-1]
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}_{seen[base]}"
            self.terms.append(RewardTerm(name, resolve(spec.fn), spec.fn, spec.weight, dict(spec.kwargs)))
        self.pool = WorkerPool(self.pool_cfg.num_workers, self.pool_cfg.timeout)
        self.counts = {t.name: {"errors": 0, "timeouts": 0} for t in self.terms}
        self._reported: set[tuple[str, str]] = set()

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """(total per completion, {function name: values})."""
        n, size = len(completions), self.pool_cfg.chunk_size
        chunks = [(s, min(n, s + size)) for s in range(0, n, size)]
        calls, where = [], []
        for term in self.terms:
            for s, e in chunks:
                cols = {k: v[s:e] for k, v in columns.items()}
                calls.append(Call(term.spec, term.kwargs, prompts[s:e], completions[s:e], cols))
                where.append((term, s, e))
        per_fn = {t.name: [0.0] * n for t in self.terms}
        for (term, s, e), out in zip(where, self.pool.run(calls)):
            if out.status == "ok":
                per_fn[term.name][s:e] = out.values
            else:
                self._failed(term, out.status, e - s, out.error)
        total = [0.0] * n
        for term in self.terms:
            total = [t + term.weight * v for t, v in zip(total, per_fn[term.name])]
        return total, per_fn

    def _failed(self, term: RewardTerm, status: str, rows: int, error: Optional[str]) -> None:
        self.counts[term.name]["errors" if status == "error" else "timeouts"] += rows
        if (term.name, status) in self._reported:
            return
        self._reported.add((term.name, status))
        if status == "error":
            log.warning("reward %r raised; its rows score 0 (later errors are only counted):\n%s", term.name, error)
        else:
            log.warning("reward %r took longer than reward_pool.timeout=%ss; its rows score 0 "
                        "(later timeouts are only counted)", term.name, self.pool_cfg.timeout)

    def pop_metrics(self) -> dict[str, float]:
        """Rows scored 0 by an error / a timeout since the last call, summed over ranks (collective)."""
        import torch

        from grpo.foundation import dist

        keys = [(name, kind) for name in self.counts for kind in ("errors", "timeouts")]
        local = torch.tensor([float(self.counts[n][k]) for n, k in keys], dtype=torch.float64)
        summed = dist.all_reduce_sum(local)
        for name in self.counts:
            self.counts[name] = {"errors": 0, "timeouts": 0}
        return {f"reward/{n}/{k}": float(v) for (n, k), v in zip(keys, summed)}

    def close(self) -> None:
        self.pool.close()
