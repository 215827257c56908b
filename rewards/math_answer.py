"""Math correctness through math-verify: extract the model's final answer, compare it with the gold one.

    rewards:
      - fn: math_correct
        kwargs: {extract: [answer_tag, boxed], gold: gsm8k, correct: 1.0, wrong: 0.0}

Where the answer is taken from (``extract``, one mode or a list tried in order):
``boxed`` (last ``\\boxed{...}``), ``answer_tag`` (last ``<answer>...</answer>``),
``gsm8k`` (after the last ``####``), ``last_number`` (the last number in the text).
The gold answer (column ``answer``; ``gold``): ``gsm8k`` (after ``####``, GSM8K's
solutions), ``boxed`` (a MATH solution's last ``\\boxed{}``), ``plain`` (the value as it
is), ``auto`` (whichever of these the text shows). Equivalent forms count as equal
(0.5 = 1/2 = \\frac{1}{2}; 1,234 = 1234).

math-verify's own timeouts use SIGALRM, which neither works off the main thread nor
interrupts a hang inside one C call; they are off here, and the reward worker pool
(grpo/workers/worker_pool.py) enforces a hard per-call timeout instead.

math-verify (with sympy and its LaTeX parser: 0.3-0.4 s) is imported at the first comparison, not with the
registry, so a run that does not score math never loads it; a reward worker imports it before its first
call (``math_correct.slow_imports``, grpo/workers/worker_pool.py's ``WarmUp``), outside any call's deadline.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional, Sequence, Union

import importlib

EXTRACT_MODES = ("boxed", "answer_tag", "gsm8k", "last_number")
GOLD_MODES = ("auto", "gsm8k", "boxed", "plain")

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; that is deliberate here (see module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


# --------------------------------------------------------------------------- extraction


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None when absent or unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def last_tag(text: str, tag: str = "answer") -> Optional[str]:
    """Content of the last complete ``<tag>...</tag>``; None when there is none (an unclosed tag does not count)."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def after_hashes(text: str) -> Optional[str]:
    """What follows the last ``####`` on its line (GSM8K's answer marker)."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    return tail or None


def last_number(text: str) -> Optional[str]:
    """The last number in the text, thousands separators removed ("1,234.5" -> "1234.5")."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _modes(extract: Union[str, Sequence[str]]) -> list[str]:
    modes = [extract] if isinstance(extract, str) else list(extract)
    bad = [m for m in modes if m not in EXTRACT_MODES]
    if bad or not modes:
        raise ValueError(f"extract={extract!r} is invalid: use one or a list of {list(EXTRACT_MODES)}")
    return modes


def extract_answer(text: str, extract: Union[str, Sequence[str]] = ("answer_tag", "boxed"), tag: str = "answer") -> Optional[str]:
    """The model's final answer as a string math-verify can parse; None when no mode finds one."""
    for mode in _modes(extract):
        if mode == "boxed":
            got = last_boxed(text)
            got = f"${got}$" if got else None
        elif mode == "answer_tag":
            got = last_tag(text, tag)
        elif mode == "gsm8k":
            got = after_hashes(text)
        else:
            got = last_number(text)
        if got:
            return got
    return None


def check_gold(gold: str) -> None:
    if gold not in GOLD_MODES:
        raise ValueError(f"gold={gold!r} is invalid: choose from {list(GOLD_MODES)}")


def gold_answer(solution: Any, gold: str = "auto") -> str:
    """The gold answer string from a GSM8K solution, a MATH solution or a plain value."""
    check_gold(gold)
    text = str(solution)
    if gold == "gsm8k" or (gold == "auto" and "####" in text):
        got = after_hashes(text)
        if got is None:
            raise ValueError(f"gold={gold!r}: the answer {text[-80:]!r} has no '#### N' line")
        return got.replace(",", "")
    if gold == "boxed" or (gold == "auto" and ("\\boxed" in text or "\\fbox" in text)):
        got = last_boxed(text)
        if got is None:
            raise ValueError(f"gold={gold!r}: the solution {text[-80:]!r} has no complete \\boxed{{...}}")
        return f"${got}$"
    return text.strip()


# --------------------------------------------------------------------------- comparison


def _math_verify():
    return importlib.import_module("math_verify")


def _parse(text: str) -> list:
    return _math_verify().parse(text, parsing_timeout=None)


def is_equivalent(gold: str, predicted: str) -> bool:
    """math-verify's comparison of two answer strings (no timeout here: see the module doc)."""
    g, p = _parse(gold), _parse(predicted)
    if not g:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    return bool(p) and _math_verify().verify(g, p, timeout_seconds=None)


def math_correct(
    prompts: list[str],
    completions: list[str],
    answer: list[Any],
    extract: Union[str, Sequence[str]] = ("answer_tag", "boxed"),
    gold: str = "auto",
    tag: str = "answer",
    correct: float = 1.0,
    wrong: float = 0.0,
    missing: Optional[float] = None,
    **_: Any,
) -> list[float]:
    """``correct`` when the extracted answer equals the gold one, else ``wrong`` (``missing`` when none was found)."""
    missing = wrong if missing is None else missing
    modes = _modes(extract)
    check_gold(gold)  # before any row (gold_answer checks it too, per row): a call on no rows finds a bad one
    scores = []
    for text, solution in zip(completions, answer):
        target = gold_answer(solution, gold)
        got = extract_answer(text, modes, tag)
        if got is None:
            scores.append(missing)
        else:
            scores.append(correct if is_equivalent(target, got) else wrong)
    return scores


math_correct.slow_imports = ("math_verify",)  # imported by a reward worker before its first call
math_correct.rows_per_call = 1  # math-verify can hang on one input, and a timeout zeroes its whole call
