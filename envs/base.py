"""The environment interface, as environments import it (its home: grpo/rollout/environment.py).

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

from grpo.rollout.environment import Environment, Observation, StepResult, ToolBox

__all__ = ["Environment", "StepResult", "ToolBox", "Observation"]
