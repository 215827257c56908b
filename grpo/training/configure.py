"""Resolve a run's configuration: the typed schema (grpo/foundation/config.py) and the algorithm
registry (algos/) put together.

    load_config(path, algo, overrides): defaults < algorithm defaults < YAML < --algo < key=value
    needs_reference(path, overrides):   whether that run queries a reference model
    needs_reference_server(path, overrides): whether it needs a reference server started for it (not with
                                        LoRA's free reference: the policy with its adapters off)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from algos import get_algorithm
from grpo.foundation.config import Config, build_config, read_user_tree
from grpo.reference.handle import adapters_off_reference


def load_config(
    path: Optional[str | Path] = None,
    algo: Optional[str] = None,
    overrides: Optional[list[str]] = None,
) -> Config:
    """Resolve and validate; a wrong key or value raises ConfigError naming the valid choices."""
    tree, name = read_user_tree(path, algo, overrides)
    return build_config(tree, get_algorithm(name))


def needs_reference(config: Optional[str | Path], overrides: list[str]) -> bool:
    """Whether training ``config`` with ``overrides`` uses a reference model (its algorithm with its beta)."""
    cfg = load_config(config, None, overrides)
    return get_algorithm(cfg.algo.name)(cfg).needs_reference


def needs_reference_server(config: Optional[str | Path], overrides: list[str]) -> bool:
    """Whether a script should start a reference server for this run: it uses a reference, and that reference
    is not LoRA's free one (model.lora without ref.url / ref.model: the policy with its adapters off)."""
    cfg = load_config(config, None, overrides)
    return get_algorithm(cfg.algo.name)(cfg).needs_reference and not adapters_off_reference(cfg)
