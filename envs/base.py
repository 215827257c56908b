"""The environment interface and how a run builds its environments from ``env`` in the config.

Write an environment as a class (one file), named in the YAML as ``env.name: mypkg.myenv:MyEnv``::

    class MyEnv(Environment):
        default_tools = ["calculator"]            # tools it calls, unless env.tools says otherwise

        def __init__(self, tools: ToolBox, **kwargs): ...   # env.kwargs; one instance per trajectory
        def reset(self, row) -> str | list[dict]:  ...       # the first observation (the prompt)
        def step(self, action: str) -> StepResult: ...      # the policy's turn (text, EOS removed)
        def reward_terms(self) -> dict[str, float]: ...     # optional: named parts of the return
        @classmethod
        def tasks(cls, num_examples, seed, **kwargs) -> list[dict]: ...   # optional: data.source: env

``reset`` must be deterministic in the row (the G trajectories of a group share their prompt).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar, Optional

from envs import EnvConfigError, resolve_env, resolve_tool
from envs.sandbox import ToolBox
from grpo.rollout.multiturn import Observation, StepResult

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
        raise EnvConfigError(f"data.source='env': the environment {cls.__name__} generates no tasks; "
                             "give a dataset (data.source: jsonl, ...) with the columns it reads")


class EnvSetup:
    """The run's environment class, its kwargs and its tool box (a worker pool: ``close`` it)."""

    def __init__(self, env_cfg: Any):
        self.cfg = env_cfg
        self.cls = resolve_env(env_cfg.name)
        if not (callable(getattr(self.cls, "reset", None)) and callable(getattr(self.cls, "step", None))):
            raise EnvConfigError(f"env.name={env_cfg.name!r} has no reset/step: an environment implements "
                                 "envs.base.Environment")
        self.kwargs = dict(env_cfg.kwargs)
        specs = env_cfg.tools
        if specs is None:
            specs = [type("Spec", (), {"fn": n, "kwargs": {}, "name": None})()
                     for n in getattr(self.cls, "default_tools", [])]
        tools = {}
        for s in specs:
            resolve_tool(s.fn)  # a wrong name fails now, not in a worker
            tools[s.name or s.fn.split(":")[-1]] = (s.fn, dict(s.kwargs))
        self.toolbox = ToolBox(tools, env_cfg.tool_workers, env_cfg.tool_timeout, env_cfg.max_tool_output_chars)
        self._takes_tools = "tools" in inspect.signature(self.cls).parameters

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
            raise EnvConfigError(f"env.name={self.cfg.name!r}: its tasks need a 'prompt' column (the first observation)")
        return rows

    def close(self) -> None:
        self.toolbox.close()
