"""Built-in tools: ``fn(args_text, **kwargs) -> str``. They run in the sandbox's worker processes.

Nothing the model writes is handed to ``eval`` or a shell: the calculator parses integers,
``+ - * /`` and parentheses with the recursive-descent parser of rewards/countdown.py and
evaluates exactly with fractions.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from rewards.countdown import evaluate


def calculator(expression: str, max_abs: int = 10**12, **_: object) -> str:
    """The value of an arithmetic expression: an integer, or a reduced fraction ``p/q``.
    Raises on anything else (the sandbox counts it as a tool error)."""
    value, _ = evaluate(expression.strip())
    if abs(value) > max_abs:
        raise ValueError(f"result beyond {max_abs}")
    return format_number(value)


def format_number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def python(code: str, sandbox: Any = None, max_chars: int = 1000, **_: object) -> str:
    """Run ``code`` (Python source) in the sandbox (grpo/workers/sandbox.py, the run's ``sandbox:`` limits) and answer
    its stdout; when it fails, its stdout and the last line of its error (or why it was stopped). Whatever the
    code does ends with this call: the answer is text for the policy, not an error of the tool. A program the
    sandbox could not run (a namespace or a fork refused) is: SandboxError, counted as the tool's error."""
    from grpo.workers.sandbox import SandboxError, run_python

    r = run_python(code, sandbox)
    if r.reason == "error":
        raise SandboxError(f"the sandbox could not run the program: {r.error}")
    out = r.stdout.rstrip()
    if len(out) > max_chars:
        out = out[:max_chars] + "\n[output cut]"
    if not r.ok:
        last = (r.stderr.strip().splitlines() or [""])[-1][:max_chars]
        why = {"timeout": "timed out", "cpu": "used up its CPU time", "memory": "ran out of memory",
               "output_limit": "wrote too much output", "signal": f"was killed (signal {-(r.returncode or 0)})"
               }.get(r.reason, f"exited with code {r.returncode}")
        out = "\n".join(part for part in (out, last, f"[the program {why}]") if part)
    return out


python.uses_sandbox = True  # EnvSetup passes the run's ``sandbox:`` limits as the ``sandbox`` kwarg
