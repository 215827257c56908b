"""Environments of multi-turn rollouts and the tools they call (``env`` in the config).

An environment is made per trajectory from a dataset row: ``reset(row)`` gives the first
observation (text, or chat messages), ``step(action_text)`` answers each policy turn with a
``StepResult`` (next observation, step reward, done). Named in the YAML like reward functions:
a registered name below or ``package.module:Class``, with ``kwargs``. Built in:

    calculator   arithmetic problems in MT-GRPO's two-turn shape (call the calculator, then answer)
    maze         a small grid maze as text, actions u/d/l/r, invalid-action penalty (GiGPO's anchor states)
    code         write a function: try code with the ``python`` tool, then submit; scored by its unit tests

Environment code itself runs in the trainer process: it is trusted code, like the trainer. Only tools run in
worker processes, and model-written code only through the sandbox (the ``python`` tool, docs/sandbox.md).

Tools (``env.tools``; registered names or ``package.module:function``, ``fn(args_text, **kwargs) -> str``)
run in sandboxed worker processes (envs/sandbox.py). This module stays light: the worker processes
import it to find tools, so environments are imported only when named.
"""

from __future__ import annotations

import importlib
from typing import Callable

# name -> "module:attribute" (imported on demand)
ENVS: dict[str, str] = {
    "calculator": "envs.calculator:CalculatorEnv",
    "maze": "envs.maze:MazeEnv",
    "code": "envs.code:CodeEnv",
}
TOOLS: dict[str, str] = {
    "calculator": "envs.tools:calculator",
    "python": "envs.tools:python",
}


class EnvConfigError(ValueError):
    """Raised for a wrong env/tool name; the trainer turns it into a ConfigError."""


def _load(spec: str, what: str, key: str, registry: dict[str, str]) -> Callable:
    target = registry.get(spec, spec)
    if ":" not in target:
        raise EnvConfigError(f"{key}={spec!r} is unknown: choose from {sorted(registry)} or give "
                             f"'package.module:{what}'")
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise EnvConfigError(f"{key}={spec!r} cannot be imported: {e}") from e


def resolve_env(name: str) -> type:
    return _load(name, "Class", "env.name", ENVS)


def resolve_tool(name: str) -> Callable[..., str]:
    fn = _load(name, "function", "env.tools fn", TOOLS)
    if not callable(fn):
        raise EnvConfigError(f"env.tools fn={name!r} is not callable")
    return fn
