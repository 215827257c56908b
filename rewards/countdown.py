"""Countdown: an arithmetic expression that uses each given number exactly once and reaches the target.

The expression (by default the content of the last ``<answer>...</answer>``) is parsed by
a small recursive-descent parser that knows integers, ``+ - * /`` and parentheses and
nothing else, and is evaluated exactly with fractions. No text is ever handed to
``eval``; anything else (names, calls, ``**``, unary minus, decimals, ``=``) is rejected.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Any, Optional, Sequence

from rewards.math_answer import last_tag

MAX_CHARS = 200  # longer "expressions" are rejected before parsing
MAX_DEPTH = 32  # parenthesis nesting
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")


class ExpressionError(ValueError):
    """The text is not an expression of integers, + - * / and parentheses."""


def tokenize(text: str) -> list[str]:
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ExpressionError(f"unexpected character {text[pos:].lstrip()[:1]!r} at {pos}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'"""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0
        self.numbers: list[int] = []

    def peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExpressionError("expression ends too early")
        self.i += 1
        return tok

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ExpressionError("division by zero")
            else:
                value = value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        tok = self.take()
        if tok == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if tok.isdigit():
            if len(tok) > 1 and tok.startswith("0"):
                raise ExpressionError(f"number with a leading zero: {tok!r}")
            self.numbers.append(int(tok))
            return Fraction(int(tok))
        raise ExpressionError(f"unexpected {tok!r}")


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, the numbers used in order); raises ExpressionError on anything but + - * / ( ) and integers."""
    parser = _Parser(tokenize(expression))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after the expression")
    return value, parser.numbers


def check(expression: Optional[str], nums: Sequence[int], target: int) -> str:
    """'correct' | 'wrong' (valid, every number once, other value) | 'invalid' (anything else)."""
    if not expression:
        return "invalid"
    try:
        value, used = evaluate(expression)
    except ExpressionError:
        return "invalid"
    if Counter(used) != Counter(int(n) for n in nums):
        return "invalid"
    return "correct" if value == Fraction(int(target)) else "wrong"


def countdown(
    prompts: list[str],
    completions: list[str],
    nums: list[Sequence[int]],
    target: list[int],
    extract: str = "answer_tag",
    correct: float = 1.0,
    wrong: float = 0.0,
    invalid: float = 0.0,
    **_: Any,
) -> list[float]:
    """``correct`` when the expression reaches the target using each number once; ``wrong`` for a valid
    expression with the right numbers and another value; ``invalid`` otherwise (no answer, bad syntax,
    numbers missing / repeated / foreign, division by zero).

    ``extract``: ``answer_tag`` (last <answer>...</answer>) or ``text`` (the whole completion).
    """
    if extract not in ("answer_tag", "text"):
        raise ValueError(f"extract={extract!r} is invalid: choose 'answer_tag' or 'text'")
    values = {"correct": correct, "wrong": wrong, "invalid": invalid}
    out = []
    for text, ns, t in zip(completions, nums, target):
        expression = last_tag(text) if extract == "answer_tag" else text.strip()
        out.append(values[check(expression, ns, t)])
    return out
