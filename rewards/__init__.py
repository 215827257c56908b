"""Reward functions: the protocol, the registry, and weighted combination.

A reward function is ``fn(prompts, completions, **columns) -> list[float]``: ``prompts``
and ``completions`` are decoded texts (one entry per completion, prompts repeated for
each member of a group), ``columns`` are the dataset's columns aligned the same way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from grpo.config import ConfigError, RewardSpec
from rewards.digits import digits_match, digits_step_match


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]: ...


class StepRewardFn(Protocol):
    """Process supervision (grpo-ps): one score per reasoning step of one completion."""

    def __call__(self, prompt: str, steps: list[str], example: dict[str, Any]) -> list[float]: ...


REGISTRY: dict[str, RewardFn] = {
    "digits_match": digits_match,
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
    weight: float
    kwargs: dict


class CombinedReward:
    """Weighted sum of several reward functions; each one's values are kept for logging."""

    def __init__(self, specs: list[RewardSpec]):
        self.terms = []
        seen: dict[str, int] = {}
        for spec in specs:
            base = spec.fn.split(":")[-1]
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}_{seen[base]}"
            self.terms.append(RewardTerm(name, resolve(spec.fn), spec.weight, dict(spec.kwargs)))

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """(total per completion, {function name: values})."""
        per_fn: dict[str, list[float]] = {}
        total = [0.0] * len(completions)
        for term in self.terms:
            values = term.fn(prompts, completions, **columns, **term.kwargs)
            values = [float(v) for v in values]
            if len(values) != len(completions):
                raise ValueError(
                    f"reward {term.name!r} returned {len(values)} values for {len(completions)} completions"
                )
            per_fn[term.name] = values
            total = [t + term.weight * v for t, v in zip(total, values)]
        return total, per_fn
