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
        time.sleep(600)  # far beyond any test's bound: only the pool's timeout ends it
    return [1.0 for _ in completions]


def crash(prompts, completions, **_):
    if any("crash" in c for c in completions):
        os._exit(3)  # the worker process dies without a word
    return [1.0 for _ in completions]


def wrong_length(prompts, completions, **_):
    return [1.0]


not_callable = 42


def not_finite(prompts, completions, **_):
    """nan / inf for completions that say so (numpy-style results of a 0/0 or a log(0)), and 1e300, finite in
    Python and inf in the trainer's float32 rewards."""
    return [float(c) if c in ("nan", "inf", "-inf", "1e300") else 1.0 for c in completions]


# --- TRL-shaped functions (keyword arguments, None for rows they do not score, async) -------------------
def trl_needs_solution(completions, solution, **kwargs):
    """Written for a dataset with a ``solution`` column: fails where there is none."""
    return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]


def trl_id_count(prompts, completions, completion_ids, **kwargs):
    """Number of generated tokens; None (not scored) when the prompt says skip."""
    return [None if "skip" in str(p) else float(len(ids)) for p, ids in zip(prompts, completion_ids)]


class _OverlongPunishment:
    """TRL's factory rewards' shape (``get_soft_overlong_punishment``, ``get_repetition_penalty_reward``): a
    callable whose call takes ``completion_ids`` first and no prompts."""

    def __init__(self, max_len):
        self.max_len = max_len

    def __call__(self, completion_ids, **kwargs):
        return [-max(0.0, len(ids) - self.max_len) for ids in completion_ids]


trl_factory_object = _OverlongPunishment(1)


def _make_trl_factory_function(max_len):
    def overlong(completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [-max(0.0, len(ids) - max_len) for ids in completion_ids]
    return overlong


trl_factory_function = _make_trl_factory_function(1)


def trl_exact(completions, answer, **kwargs):
    """1 when the completion is the answer; completions are message lists for conversational prompts."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t == a else 0.0 for t, a in zip(texts, answer)]


def trl_step(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step)] * len(completions)


def trl_no_kwargs(completions, answer):
    """No **kwargs: gets only what it names."""
    return [float(len(c)) for c in completions]


async def trl_async_half(prompts, completions, delay=0.0, **kwargs):
    """Async: 0.5 per row, None where the completion is empty; sleeps ``delay`` seconds first."""
    import asyncio

    await asyncio.sleep(delay)
    return [None if c == "" else 0.5 for c in completions]


_MET: dict[str, int] = {}


async def trl_async_meet(prompts, completions, group="g", expect=3, **kwargs):
    """Async: 0.5 per row once ``expect`` calls of ``group`` are in flight at the same time, which happens
    only when they run concurrently; 0.0 if the others never come (one after another) within 120 s."""
    import asyncio

    _MET[group] = _MET.get(group, 0) + 1
    for _ in range(12000):
        if _MET[group] >= expect:
            return [0.5 for _ in completions]
        await asyncio.sleep(0.01)
    return [0.0 for _ in completions]


def plain_positional(p, c, **cols):
    """This project's plain shape with other parameter names: called positionally (style auto -> plain)."""
    return [2.0 if x.startswith("1") else 0.0 for x in c]


def trl_always_raises(completions, **kwargs):
    raise ValueError("this judge is misconfigured")


def hog_memory(prompts, completions, **_):
    """Allocates 2 GiB for a completion that says so (past a worker's memory limit in tests/test_sandbox.py)."""
    blocks = [bytearray(2 << 30) for c in completions if c == "hog"]
    return [float(len(blocks)) for _ in completions]


def spin(prompts, completions, **_):
    """Burns CPU forever for a completion that says so (past a worker's CPU limit)."""
    while any(c == "spin" for c in completions):
        pass
    return [1.0 for _ in completions]


def _worker_pipe():
    """The pipe a reward worker answers on, as code running in the worker can find it."""
    import gc
    from multiprocessing.connection import Connection

    return next(o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # runs wherever this is unpickled


def pipe_writer(prompts, completions, mode="pickle", marker="", **_):
    """Writes into its worker's answer pipe (what model-written code run by a reward could do), then scores 1."""
    import struct

    conn = _worker_pipe()
    if mode == "pickle":
        conn.send(_Payload(marker))  # a crafted pickle before the real answer
    elif mode == "nested":
        conn.send_bytes(b"[" * 100_000 + b"]" * 100_000)  # JSON nested past the parser's recursion limit
    elif mode == "huge":
        os.write(conn.fileno(), struct.pack("!i", 2**31 - 1))  # a length prefix of 2 GiB, then nothing
        time.sleep(600)
    elif mode == "partial":
        os.write(conn.fileno(), struct.pack("!i", 100) + b"0123456789")  # 10 of 100 bytes, then nothing
        time.sleep(600)
    return [1.0 for _ in completions]


def patches_math(prompts, completions, **_):
    """Rebinds math.isclose in its worker (as model-written code run inline could), then scores 1."""
    import math

    math.isclose = lambda *a, **k: True
    return [1.0 for _ in completions]


def uses_isclose(prompts, completions, **_):
    """1 where the completion is close to 2, by math.isclose."""
    import math

    return [1.0 if math.isclose(float(c), 2.0) else 0.0 for c in completions]


def sees_math_verify(prompts, completions, **_):
    """1.0 per row when math-verify was loaded in this process before the call, else 0.0."""
    import sys

    return [float("math_verify" in sys.modules)] * len(completions)


def sees_its_slow_imports(prompts, completions, **_):
    """The same, for a function that lists math-verify in ``slow_imports`` (a worker imports it first)."""
    return sees_math_verify(prompts, completions)


sees_its_slow_imports.slow_imports = ("math_verify",)


def rows_seen(prompts, completions, **_):
    """How many rows came in this call, on each of them (a function that asks for 3 rows a call)."""
    return [float(len(completions))] * len(completions)


rows_seen.rows_per_call = 3
