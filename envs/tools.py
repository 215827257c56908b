"""Built-in tools: ``fn(args_text, **kwargs) -> str``. They run in the sandbox's worker processes.

Nothing the model writes is handed to ``eval`` or a shell: the calculator parses integers,
``+ - * /`` and parentheses with the recursive-descent parser of rewards/countdown.py and
evaluates exactly with fractions.
"""

from __future__ import annotations

from fractions import Fraction

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
