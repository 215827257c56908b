"""The algorithm registry: ``--algo NAME`` -> a class in this package (one file each)."""

from __future__ import annotations

from algos.base import Algorithm
from algos.grpo import GRPO

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (GRPO,)}


def get_algorithm(name: str) -> type[Algorithm]:
    from grpo.config import ConfigError

    if name not in ALGORITHMS:
        import difflib

        close = difflib.get_close_matches(name, list(ALGORITHMS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown algorithm {name!r}.{hint} Choose from {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]
