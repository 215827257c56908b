"""Custom reward functions for the tests, named by import path (``tests.reward_fixtures:NAME``) as a user would."""

import os
import time


def length_bonus(prompts, completions, scale=1.0, **_):
    return [scale * len(c) for c in completions]


def boom(prompts, completions, **_):
    if any("boom" in c for c in completions):
        raise RuntimeError("kaboom: this reward fails on purpose")
    return [1.0 for _ in completions]


def slow(prompts, completions, **_):
    if any("slow" in c for c in completions):
        time.sleep(60)
    return [1.0 for _ in completions]


def crash(prompts, completions, **_):
    if any("crash" in c for c in completions):
        os._exit(3)  # the worker process dies without a word
    return [1.0 for _ in completions]


def wrong_length(prompts, completions, **_):
    return [1.0]


not_callable = 42


def not_finite(prompts, completions, **_):
    """nan / inf for completions that say so (numpy-style results of a 0/0 or a log(0))."""
    return [float(c) if c in ("nan", "inf", "-inf") else 1.0 for c in completions]
