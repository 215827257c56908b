"""Calculator: arithmetic problems in MT-GRPO's two-turn shape (arXiv 2505.11821).

    turn 1   the policy reasons (optional) and calls the calculator: ``{call_open}EXPR{call_close}``, ending
             its turn (EOS or a stop string: a call cut off at the turn's token limit is malformed)
    env      the calculator's result as a ``tool`` message (``error`` when the call failed)
    turn 2   the policy answers: a bare integer, or ``{answer_open}N{answer_close}`` when tags are set

A first turn without a call is taken as the final answer (a trajectory with no environment result).
Rewards, at the end (the last step's reward is their sum, earlier steps earn 0):

    turn reward R^T    = turn_weight   if the call was well formed, executed, and its result is the answer
                                       (the result appears in the answer as a whole number), else 0
    outcome reward R^O = correct_weight * correct + format_weight * [the answer is a bare integer, turn ended]

``correct`` is 1 for the right answer (a bare integer, equal to it), else 0 with ``partial_credit: none``
(default). A wrong answer can earn partial credit instead: ``numeric`` the larger of 1 / (1 + |answer -
right answer|) (for an integer answer) and the ``chars`` credit, ``chars`` the share of characters that
match position by position (the digits task's reward). Off by default because a policy games it: the
tiny model learned a constant call (``=1``) whose copied result is near or shares a leading digit with
many answers, and stayed there (README, "Learning on a CPU").
``reward_terms()`` = {"turn": R^T, "outcome": R^O, "exact": [right answer]} (mt-grpo reads the first two;
``exact`` is logged as ``reward/exact/mean``, the exact-answer accuracy, partial credit never in it).

Defaults suit the tiny char models with ``data.prefill: "="`` (configs/mt-grpo.yaml): the prompt is
``7+5``, the call ``=7+5`` (the prefill writes the ``=``), the tool answers ``12``, the answer is ``12``.
``bare_frac`` makes that share of the problems a bare number (``3``: call ``=3``, answer ``3``; symbols
style only), the easiest problems of a curriculum for a model that must first learn to copy.
``style: words`` renders word problems ("Ann has 7 apples and gets 5 more. ...") for real models,
with tags such as ``call_open: "<calc>", call_close: "</calc>"``.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional

from envs.base import Environment, StepResult, ToolBox

_INT = re.compile(r"-?\d+")
_NAMES = ["Ann", "Ben", "Mia", "Tom", "Eva", "Raj", "Li", "Sam"]
_THINGS = ["apple", "book", "coin", "pen", "card", "shell"]
_WORDS = {
    "+": "{n} has {a} {t}s and gets {b} more. How many {t}s does {n} have now?",
    "-": "{n} has {a} {t}s and gives away {b}. How many {t}s are left?",
    "*": "{n} buys {a} bags with {b} {t}s in each. How many {t}s is that?",
}


def char_match(text: str, gold: str) -> float:
    """Share of positions where ``text`` equals ``gold``, over the longer of the two."""
    n = max(len(text), len(gold))
    return sum(a == b for a, b in zip(text, gold)) / n if n else 1.0


class CalculatorEnv(Environment):
    default_tools = ["calculator"]

    def __init__(self, tools: Optional[ToolBox] = None, call_open: str = "=", call_close: str = "",
                 answer_open: str = "", answer_close: str = "", turn_weight: float = 1.0,
                 correct_weight: float = 1.0, format_weight: float = 0.2, partial_credit: str = "none",
                 **_: Any):
        super().__init__(tools)
        self.call_open, self.call_close = call_open, call_close
        self.answer_open, self.answer_close = answer_open, answer_close
        self.turn_weight, self.correct_weight, self.format_weight = turn_weight, correct_weight, format_weight
        if partial_credit not in ("numeric", "chars", "none"):
            raise ValueError(f"env.kwargs.partial_credit={partial_credit!r} is invalid: choose from "
                             "['numeric', 'chars', 'none']")
        self.partial_credit = partial_credit

    # ----------------------------------------------------------------- tasks
    @classmethod
    def tasks(cls, num_examples: int, seed: int, max_value: int = 9, ops: str = "+-*", style: str = "symbols",
              bare_frac: float = 0.0, **_: Any) -> list[dict[str, Any]]:
        if not isinstance(max_value, int) or max_value < 0:
            raise ValueError(f"env.kwargs.max_value={max_value!r} is invalid: an integer >= 0")
        if style not in ("symbols", "words"):
            raise ValueError(f"env.kwargs.style={style!r} is invalid: choose from ['symbols', 'words']")
        if not 0.0 <= bare_frac <= 1.0 or (bare_frac and style != "symbols"):
            raise ValueError(f"env.kwargs.bare_frac={bare_frac!r} is invalid: a share in [0, 1], with style: symbols")
        bad = set(ops) - set(_WORDS)
        if not ops or bad:
            raise ValueError(f"env.kwargs.ops={ops!r} is invalid: use some of '+-*'")
        rng = random.Random(seed)
        rows = []
        for _ in range(num_examples):
            op = rng.choice(ops)
            a, b = rng.randint(0, max_value), rng.randint(0, max_value)
            if op == "-" and b > a:
                a, b = b, a
            value = a + b if op == "+" else a - b if op == "-" else a * b
            expr = f"{a}{op}{b}"
            if bare_frac and rng.random() < bare_frac:  # a bare number: its value is itself (no draw when 0)
                value, expr = a, str(a)
            prompt = expr if style == "symbols" else _WORDS[op].format(n=rng.choice(_NAMES), a=a, b=b,
                                                                       t=rng.choice(_THINGS))
            rows.append({"prompt": prompt, "answer": str(value), "expression": expr})
        return rows

    # ----------------------------------------------------------------- episode
    def reset(self, row: dict[str, Any]):
        self.gold = str(row["answer"])
        self.result: Optional[str] = None  # the tool's answer, when a call executed
        self.called = False
        self.terms = {"turn": 0.0, "outcome": 0.0, "exact": 0.0}
        return str(row["prompt"])

    def _call(self, text: str) -> Optional[str]:
        """The expression of a tool call in ``text``, or None when there is no call."""
        i = text.find(self.call_open) if self.call_open else 0
        if i < 0:
            return None
        rest = text[i + len(self.call_open):]
        if self.call_close:
            j = rest.find(self.call_close)
            if j < 0:
                return None
            rest = rest[:j]
        return rest.strip()

    def _answer(self, text: str) -> tuple[str, bool]:
        """(the answer's text, whether it is well formatted: a bare integer in its place)."""
        span = text.strip()
        if self.answer_open:
            i = span.rfind(self.answer_open)
            j = span.find(self.answer_close, i + len(self.answer_open)) if i >= 0 and self.answer_close else -1
            if i < 0 or (self.answer_close and j < 0):
                nums = _INT.findall(span)
                return (nums[-1] if nums else ""), False
            span = span[i + len(self.answer_open): j if self.answer_close else None].strip()
        return span, bool(re.fullmatch(r"-?\d+", span))

    def step(self, action: str) -> StepResult:
        cut = bool(getattr(action, "truncated", False))  # the turn hit its token limit: not well formed
        if not self.called:
            expr = self._call(action)
            if expr is not None:
                self.called = True
                if cut:  # a call that did not end is not sent to the tool
                    return StepResult({"role": "tool", "content": "error"}, 0.0, False, {"invalid": True})
                res = self.tools.call("calculator", expr)
                self.result = res.output if res.ok else None
                obs = {"role": "tool", "content": res.output if res.ok else "error"}
                return StepResult(obs, 0.0, False, {"tool_call": True, "tool_ok": res.ok})
        return self._finish(action, cut)

    def _finish(self, action: str, cut: bool = False) -> StepResult:
        answer, formatted = self._answer(action)
        formatted = formatted and not cut  # the answer must end its turn (EOS) to count as formatted
        if formatted and answer == self.gold:
            correct = 1.0
        elif self.partial_credit == "chars":
            correct = char_match(answer, self.gold)
        elif self.partial_credit == "numeric":
            near = 1.0 / (1.0 + abs(int(answer) - int(self.gold))) if re.fullmatch(r"-?\d{1,12}", answer) else 0.0
            correct = max(near, char_match(answer, self.gold))
        else:
            correct = 0.0
        used = self.result is not None and re.search(rf"(?<![\d/]){re.escape(self.result)}(?![\d/])", answer)
        self.terms = {"turn": self.turn_weight * float(bool(used)),
                      "outcome": self.correct_weight * correct + self.format_weight * float(formatted),
                      "exact": float(formatted and answer == self.gold)}
        return StepResult(None, self.terms["turn"] + self.terms["outcome"], True,
                          {"invalid": not answer})

    def reward_terms(self) -> dict[str, float]:
        return dict(self.terms)
