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
run in sandboxed worker processes (grpo/workers/tools.py). This module stays light: the worker processes
import it to find tools, so environments are imported only when named. The interface an environment implements:
envs/base.py.
"""

from __future__ import annotations

from grpo.foundation.plugins import ENVS, TOOLS

ENVS.register("calculator", "envs.calculator:CalculatorEnv")
ENVS.register("maze", "envs.maze:MazeEnv")
ENVS.register("code", "envs.code:CodeEnv")
TOOLS.register("calculator", "envs.tools:calculator")
TOOLS.register("python", "envs.tools:python")
