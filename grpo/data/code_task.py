"""The built-in code task (``data.source: code``): seeded, offline "write the function" problems with their tests.

Each item names a function and its behaviour, with a few assert tests generated from a reference solution (the
``tests`` and ``entry_point`` columns the ``code_tests`` reward reads).
Families (``data.code.families``) draw their constants from the seed, so names and behaviours vary::

    add_k      add_7(x) -> x + 7                 mul_k       times_3(x) -> 3 * x
    clamp      clamp_2_9(x) -> x limited to [2, 9]   count_c   count_e(s) -> how many 'e' in s
    sum_list   sum_list(xs) -> sum of xs         max_list    max_list(xs) -> largest item
    reverse    reverse(s) -> s backwards         is_mult_k   is_mult_4(x) -> x % 4 == 0
"""

from __future__ import annotations

import random
import string
from typing import Any, Callable

PROMPT = ("Write a Python function `{signature}` that {behaviour}. Answer with the function in a ```python code "
          "block.")


def _fam(rng: random.Random) -> dict[str, tuple[str, str, str, Callable[[random.Random], list], Callable]]:
    k, m, c = rng.randint(2, 9), rng.randint(2, 9), rng.choice("aeiost")
    lo, hi = sorted(rng.sample(range(0, 20), 2))
    ints = lambda r: [r.randint(-20, 20)]  # noqa: E731
    lists = lambda r: [[r.randint(-9, 9) for _ in range(r.randint(1, 6))]]  # noqa: E731
    words = lambda r: ["".join(r.choice(string.ascii_lowercase[:8] + "eost") for _ in range(r.randint(0, 8)))]  # noqa: E731
    return {
        "add_k": (f"add_{k}", "x", f"returns x plus {k}", ints, lambda x: x + k),
        "mul_k": (f"times_{m}", "x", f"returns x multiplied by {m}", ints, lambda x: x * m),
        "clamp": (f"clamp_{lo}_{hi}", "x", f"returns x limited to the range [{lo}, {hi}] (below {lo} gives {lo}, "
                  f"above {hi} gives {hi})", lambda r: [r.randint(lo - 6, hi + 6)], lambda x: min(max(x, lo), hi)),
        "count_c": (f"count_{c}", "s", f"returns how many times the letter '{c}' occurs in the string s", words,
                    lambda s: s.count(c)),
        "sum_list": ("sum_list", "xs", "returns the sum of the list of integers xs", lists, lambda xs: sum(xs)),
        "max_list": ("max_list", "xs", "returns the largest item of the non-empty list of integers xs", lists,
                     lambda xs: max(xs)),
        "reverse": ("reverse", "s", "returns the string s reversed", words, lambda s: s[::-1]),
        "is_mult_k": (f"is_mult_{m}", "x", f"returns True when x is a multiple of {m}, else False", ints,
                      lambda x: x % m == 0),
    }


FAMILIES = tuple(_fam(random.Random(0)))


def code_task(num_examples: int, seed: int, num_tests: int = 4, families: tuple[str, ...] = FAMILIES
              ) -> list[dict[str, Any]]:
    """``num_examples`` items: prompt, tests (assert statements), entry_point, family."""
    bad = sorted(set(families) - set(FAMILIES))
    if bad or not families:
        raise ValueError(f"data.code.families={list(families)!r} is invalid: choose some of {list(FAMILIES)}")
    rng = random.Random(seed)
    items = []
    for _ in range(num_examples):
        fam = rng.choice(list(families))
        name, arg, behaviour, draw, ref = _fam(rng)[fam]
        tests, seen = [], set()
        for _ in range(num_tests * 5):
            args = draw(rng)
            key = repr(args)
            if key in seen:
                continue
            seen.add(key)
            tests.append(f"assert {name}({', '.join(map(repr, args))}) == {ref(*args)!r}")
            if len(tests) == num_tests:
                break
        items.append({"prompt": PROMPT.format(signature=f"{name}({arg})", behaviour=behaviour), "tests": tests,
                      "entry_point": name, "family": fam})
    return items


class CodeTask:
    """``data.source: code``: the items of :func:`code_task` (seeded by ``data.seed``)."""

    def __init__(self, cfg: Any, seed: int = 0):
        self.items = code_task(cfg.num_examples, seed, cfg.num_tests, tuple(cfg.families))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.items[i])
