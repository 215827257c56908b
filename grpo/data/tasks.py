"""Known task schemas (column presets and prompt templates), ready system prompts, and the seeded
generators: Countdown and arithmetic word problems."""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

from grpo.foundation.config import ArithmeticTaskConfig, ConfigError, CountdownTaskConfig

# DeepSeek-R1-Zero's reasoning prompt (arXiv 2501.12948, table 1), as a system prompt.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>."
)
SYSTEM_PROMPTS = {"r1": R1_SYSTEM_PROMPT}

# TinyZero's Countdown prompt (the Countdown-Tasks-3to4 recipe).
COUNTDOWN_TEMPLATE = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
    "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)


MBPP_TEMPLATE = ("{prompt} Your code should pass these tests:\n{tests[0]}\nAnswer with the function in a ```python "
                 "code block.")
HUMANEVAL_TEMPLATE = "Complete this Python function. Answer with the whole function in a ```python code block.\n{prompt}"


@dataclass(frozen=True)
class TaskPreset:
    """Our column name -> the dataset's column name, and the prompt template (None: the ``prompt`` column)."""

    columns: dict[str, str]
    template: Optional[str] = None


TASKS = {
    "custom": TaskPreset({"prompt": "prompt"}),
    "gsm8k": TaskPreset({"prompt": "question", "answer": "answer"}),
    "math": TaskPreset({"prompt": "problem", "answer": "solution"}),
    "countdown": TaskPreset({"nums": "nums", "target": "target"}, COUNTDOWN_TEMPLATE),
    # MBPP rows (text, test_list): the tests show the function's name, as in the MBPP paper's prompt
    "mbpp": TaskPreset({"prompt": "text", "tests": "test_list"}, MBPP_TEMPLATE),
    # HumanEval rows (prompt = signature + docstring, test = def check(candidate), entry_point)
    "humaneval": TaskPreset({"prompt": "prompt", "tests": "test", "entry_point": "entry_point"}, HUMANEVAL_TEMPLATE),
}


def system_prompt(value: Optional[str]) -> Optional[str]:
    """A ready prompt's text when ``value`` names one ("r1"), else ``value`` itself."""
    return SYSTEM_PROMPTS.get(value, value) if value else None


# --------------------------------------------------------------------------- Countdown generator


def _combine(rng: random.Random, a: Fraction, b: Fraction) -> Optional[Fraction]:
    """A random + - * / of two values that stays a positive integer (None when the draw does not)."""
    op = rng.choice("+-*/")
    if op == "+":
        v = a + b
    elif op == "-":
        v = max(a, b) - min(a, b)
    elif op == "*":
        v = a * b
    else:
        hi, lo = max(a, b), min(a, b)
        v = hi / lo if lo and (hi / lo).denominator == 1 else None
    return v if v is not None and v > 0 and v.denominator == 1 else None


COUNTDOWN_MAX_DRAWS = 10_000  # random draws per problem; the defaults need about 5, 16 numbers about 2000


def countdown_example(rng: random.Random, cfg: CountdownTaskConfig) -> dict[str, Any]:
    """Numbers and a target reachable with each number exactly once (built by combining them).

    A draw fails when a combination leaves the positive integers or the result passes
    ``max_target``; the more numbers, the likelier. Past ``COUNTDOWN_MAX_DRAWS`` failed draws
    the settings are reported instead of searched forever.
    """
    for _ in range(COUNTDOWN_MAX_DRAWS):
        n = rng.randint(cfg.min_numbers, cfg.max_numbers)
        nums = [rng.randint(1, cfg.max_number) for _ in range(n)]
        pool = [Fraction(x) for x in nums]
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            v = _combine(rng, pool[i], pool[j])
            if v is None:
                break
            pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [v]
        if len(pool) == 1 and 1 <= pool[0] <= cfg.max_target:
            return {"nums": nums, "target": int(pool[0])}
    raise ConfigError(
        f"data.countdown.min_numbers={cfg.min_numbers} (max_numbers={cfg.max_numbers}, max_number={cfg.max_number}, "
        f"max_target={cfg.max_target}): no solvable problem in {COUNTDOWN_MAX_DRAWS} random draws; with that many "
        f"numbers a random combination of all of them almost never stays a positive integer within 1..max_target. "
        f"Lower data.countdown.min_numbers and max_numbers (Countdown-Tasks-3to4 uses 3 to 4; up to about 14 "
        f"works with the default max_number/max_target) or raise data.countdown.max_target"
    )


class CountdownTask:
    """Seeded Countdown problems in the Countdown-Tasks-3to4 schema (``nums``, ``target``)."""

    def __init__(self, cfg: CountdownTaskConfig, seed: int = 0):
        rng = random.Random(seed)
        self.items = [countdown_example(rng, cfg) for _ in range(cfg.num_examples)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.items[i])


# --------------------------------------------------------------------------- arithmetic word problems

_NAMES = ["Sam", "Mia", "Omar", "Lena", "Ravi", "Ana", "Tom", "Yuki", "Ben", "Zoe", "Ivan", "Nora"]
_THINGS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards", "shells", "toy cars"]


def _word_problem(rng: random.Random, max_value: int) -> tuple[str, int]:
    """One short problem with one or two of + - * / and its integer answer."""
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    kind = rng.choice(["add", "sub", "mul", "div", "add_sub"])
    small = max(2, min(12, max_value // 4))
    if kind == "add":
        a, b = rng.randint(2, max_value), rng.randint(2, max_value)
        return f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?", a + b
    if kind == "sub":
        a = rng.randint(3, max_value)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {things} and gives {b} of them away. How many {things} does {name} have left?", a - b
    if kind == "mul":
        a, b = rng.randint(2, small), rng.randint(2, small)
        return f"{name} buys {a} bags with {b} {things} in each bag. How many {things} does {name} buy?", a * b
    if kind == "div":
        a, b = rng.randint(2, small), rng.randint(2, small)
        return (f"{name} shares {a * b} {things} equally among {b} friends. "
                f"How many {things} does each friend get?"), a
    a, b = rng.randint(2, max_value), rng.randint(2, max_value)
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {things}, gets {b} more and then gives {c} away. "
            f"How many {things} does {name} have left?"), a + b - c


class ArithmeticTask:
    """Seeded one- and two-step arithmetic word problems: items ``{"prompt", "answer"}`` (answer: the integer as text)."""

    def __init__(self, cfg: ArithmeticTaskConfig, seed: int = 0):
        rng = random.Random(seed)
        self.items = []
        for _ in range(cfg.num_examples):
            question, answer = _word_problem(rng, cfg.max_value)
            self.items.append({"prompt": question, "answer": str(answer)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.items[i])
