"""Code: write a named function, trying code with the ``python`` tool on the way (the tool's example environment).

Each turn the policy either runs code, ``<python>CODE</python>`` (the tool answers with the program's output or
its error, as a ``tool`` message; at most ``max_calls`` calls), or submits its function in a ```python block,
which ends the episode. The reward is the fraction of the row's tests the submission passes (the ``code_tests``
reward's runner, in the sandbox), ``mode: all`` for all-or-nothing. A turn with neither is taken as the
submission. Tasks (``data.source: env``) are the built-in code task's (grpo/data/code_task.py); any dataset with
``tests`` and ``entry_point`` columns works too.

The environment runs in the trainer process (trusted, like all environments); the model's code runs only in the
sandbox, through the tool and through the test runner.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from envs.base import Environment, StepResult, ToolBox

HINT = (" You may run Python code first by writing <python>code</python>; you will see its output. "
        "Submit the final function in a ```python block.")


class CodeEnv(Environment):
    default_tools = ["python"]

    def __init__(self, tools: Optional[ToolBox] = None, max_calls: int = 2, mode: str = "fraction",
                 sandbox: Any = None, **_: Any):
        super().__init__(tools)
        if mode not in ("fraction", "all"):
            raise ValueError(f"env.kwargs.mode={mode!r} is invalid: choose from ['fraction', 'all']")
        self.max_calls, self.mode, self.sandbox = max_calls, mode, sandbox

    @classmethod
    def tasks(cls, num_examples: int, seed: int, num_tests: int = 4, **_: Any) -> list[dict[str, Any]]:
        from grpo.data.code_task import code_task

        return [dict(r, prompt=r["prompt"] + HINT) for r in code_task(num_examples, seed, num_tests)]

    def reset(self, row: dict[str, Any]):
        self.tests, self.entry_point = row["tests"], row.get("entry_point")
        self.calls = 0
        self.terms = {"passed": 0.0, "tool_calls": 0.0}
        return str(row["prompt"])

    def step(self, action: str) -> StepResult:
        m = re.search(r"<python>(.*?)</python>", action, re.S)
        if m and "```" not in action[m.end():] and self.calls < self.max_calls:
            self.calls += 1
            self.terms["tool_calls"] = float(self.calls)
            res = self.tools.call("python", m.group(1))
            obs = res.output if res.ok else f"[the tool failed: {res.status}]"
            return StepResult({"role": "tool", "content": obs}, 0.0, False, {"tool_call": True, "tool_ok": res.ok})
        from rewards.code_tests import extract_program, run_tests

        outcomes = run_tests(extract_program(action, self.entry_point), self.tests, self.entry_point,
                             limits=self.sandbox)
        passed = sum(o == "passed" for o in outcomes) / len(outcomes) if outcomes else 0.0
        self.terms["passed"] = passed
        reward = passed if self.mode == "fraction" else float(passed == 1.0)
        return StepResult(None, reward, True, {"outcomes": outcomes})

    def reward_terms(self) -> dict[str, float]:
        return dict(self.terms)
