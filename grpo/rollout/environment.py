"""What an environment is, and how a run builds its environments from ``env`` in the config (docs/agents.md).

An environment is a class implementing :class:`Environment` (the built-in ones: envs/), named in the YAML as a
registered name or ``package.module:Class`` with ``kwargs``; one instance per trajectory. :class:`EnvSetup` is
the run's: the class resolved, its options checked at start, and the tool box of worker processes its tools run
in (grpo/workers/tools.py), which it closes at the end.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar, Optional

from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import ENVS, TOOLS
from grpo.rollout.multiturn import Observation, StepResult
from grpo.workers.tools import ToolBox

__all__ = ["Environment", "StepResult", "ToolBox", "EnvSetup", "Observation"]


class Environment:
    default_tools: ClassVar[list[str]] = []

    def __init__(self, tools: Optional[ToolBox] = None, **kwargs: Any):
        self.tools = tools

    def reset(self, row: dict[str, Any]) -> Observation:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    @classmethod
    def tasks(cls, num_examples: int, seed: int, **kwargs: Any) -> list[dict[str, Any]]:
        raise ConfigError(f"data.source='env': the environment {cls.__name__} generates no tasks; "
                             "give a dataset (data.source: jsonl, ...) with the columns it reads")


class EnvSetup:
    """The run's environment class, its kwargs and its tool box (a worker pool: ``close`` it)."""

    def __init__(self, env_cfg: Any, sandbox: Any = None):
        self.cfg = env_cfg
        self.cls, specs = self.resolve(env_cfg)
        self.kwargs = dict(env_cfg.kwargs)
        tools = {}
        for s in specs:
            kwargs = dict(s.kwargs)
            if getattr(TOOLS.get(s.fn), "uses_sandbox", False) and "sandbox" not in kwargs:
                # the run's sandbox limits, its wall clock inside the tool call's own timeout
                limits = dict(vars(sandbox)) if sandbox is not None else {"timeout": 5.0}
                limits["timeout"] = min(limits["timeout"], max(0.5, env_cfg.tool_timeout - 1.0))
                kwargs["sandbox"] = limits
                from grpo.workers.sandbox import announce

                announce(limits)  # what holds on this machine, and what does not, said at start
            tools[s.name or s.fn.split(":")[-1]] = (s.fn, kwargs)
        self.toolbox = ToolBox(tools, env_cfg.tool_workers, env_cfg.tool_timeout, env_cfg.max_tool_output_chars,
                               env_cfg.tool_limits)
        params = inspect.signature(self.cls).parameters
        self._takes_tools = "tools" in params
        if "sandbox" in params and "sandbox" not in self.kwargs:  # an environment that runs model code itself
            self.kwargs["sandbox"] = dict(vars(sandbox)) if sandbox is not None else None

    @staticmethod
    def resolve(env_cfg: Any) -> tuple[type, list[Any]]:
        """The environment class and its tool specs, every name resolved (a wrong one raises ConfigError
        now, not in a worker); starts nothing, so the start-up checks call it too."""
        cls = ENVS.get(env_cfg.name)
        if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
            raise ConfigError(f"env.name={env_cfg.name!r} has no reset/step: an environment implements "
                              "envs.base.Environment")
        specs = env_cfg.tools
        if specs is None:
            specs = [type("Spec", (), {"fn": n, "kwargs": {}, "name": None})()
                     for n in getattr(cls, "default_tools", [])]
        for s in specs:
            TOOLS.get(s.fn)
        return cls, list(specs)

    @classmethod
    def check(cls, env_cfg: Any, sandbox: Any = None, data_source: str = "") -> None:
        """What a run would otherwise find only inside its rollouts, checked at start (raises ConfigError):
        an ``env.kwargs`` key that neither the environment's constructor nor its ``tasks`` names (when they
        swallow the rest as ``**_``, a misspelling was silently ignored), and a bad value, by building one
        environment (no tools) and, with ``data.source: env``, drawing a few of its tasks."""
        env_cls, specs = cls.resolve(env_cfg)
        calls = list(getattr(env_cls, "default_tools", []) or [])  # the names the environment calls
        given = [s.name or s.fn.split(":")[-1] for s in specs]
        missing = [n for n in calls if n not in given]
        if missing:  # every such call would fail as an unknown tool
            raise ConfigError(f"env.name={env_cfg.name!r} calls the tools {missing}, and env.tools names "
                                 f"{given}: give each the name the environment calls "
                                 f"(env.tools: [{{fn: ..., name: {missing[0]}}}])")
        kwargs = dict(env_cfg.kwargs)
        named: set[str] = set()
        open_ended = False
        for fn in (env_cls.__init__, getattr(env_cls, "tasks", None)):
            if fn is None or getattr(fn, "__func__", fn) in (Environment.__init__, Environment.tasks.__func__):
                continue  # the base class's: takes no options
            for p in inspect.signature(fn).parameters.values():
                if p.kind is p.VAR_KEYWORD:
                    open_ended |= not p.name.startswith("_")  # **kwargs may be used; **_ is thrown away
                elif p.name not in ("self", "cls", "tools", "num_examples", "seed"):
                    named.add(p.name)
        unknown = sorted(set(kwargs) - named - {"sandbox"})
        if unknown and not open_ended:
            raise ConfigError(f"env.kwargs {unknown} are not options of env.name={env_cfg.name!r}: it takes "
                                 f"{sorted(named - {'sandbox'})}")
        params = inspect.signature(env_cls).parameters
        if "sandbox" in params and "sandbox" not in kwargs:
            kwargs["sandbox"] = dict(vars(sandbox)) if sandbox is not None else None
        try:
            env_cls(**({"tools": None} if "tools" in params else {}), **kwargs)  # the tools come at run time
            if data_source == "env":
                env_cls.tasks(min(int(getattr(env_cfg, "num_examples", 4)), 4), 0, **kwargs)
        except ConfigError:
            raise
        except Exception as e:  # a bad option value, found here instead of in every trajectory
            raise ConfigError(f"env.name={env_cfg.name!r} with env.kwargs={dict(env_cfg.kwargs)!r}: "
                                 f"{type(e).__name__}: {e}") from e

    def make(self, row: dict[str, Any]) -> Any:
        """A fresh environment for one trajectory (``row`` is for environments that need it at construction)."""
        if self._takes_tools:
            return self.cls(tools=self.toolbox, **self.kwargs)
        return self.cls(**self.kwargs)

    @property
    def factory(self) -> Callable[[dict], Any]:
        return self.make

    def tasks(self, num_examples: int, seed: int) -> list[dict[str, Any]]:
        rows = self.cls.tasks(num_examples, seed, **self.kwargs)
        if not rows or "prompt" not in rows[0]:
            raise ConfigError(f"env.name={self.cfg.name!r}: its tasks need a 'prompt' column (the first observation)")
        return rows

    def close(self) -> None:
        self.toolbox.close()
