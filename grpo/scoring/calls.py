"""How one reward function is called: TRL's keyword shape or this project's plain one.

``trl``    ``fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns, **kwargs)``
           as TRL's GRPOTrainer calls it: ``prompts`` are the dataset's prompts (a list of messages when the
           dataset is conversational), ``completions`` are texts, or ``[{"role": "assistant", "content": text}]``
           when the prompts are messages; ``completion_ids`` the generated token ids; ``trainer_state`` a
           :class:`StepInfo` (``global_step``, ``max_steps``, ``epoch``). A function without ``**kwargs`` gets
           only the arguments it names. It may return ``None`` for a row it does not score, and may be
           ``async def``.
``plain``  ``fn(prompts, completions, **columns, **kwargs)`` positionally, with the chat-templated prompt
           texts and the completion texts (the built-in rewards, and functions written for it).

``style: auto`` picks ``plain`` for the built-in (registered) names and for a function without a parameter named
``completions`` (e.g. ``def f(p, c, **cols)``), ``trl`` for every other one (TRL functions always name it).
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import REWARDS
from grpo.workers.worker_pool import Outcome

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: a reward beyond it is inf in the trainer's tensor


@dataclass
class StepInfo:
    """What TRL's ``trainer_state`` offers a reward function for shaping over training (picklable)."""

    global_step: int = 0  # optimizer steps done before this one
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class Rows:
    """One step's rows, as every kind of reward source needs them."""

    prompts: list[str]  # chat-templated prompt texts (what the policy saw)
    completions: list[str]  # decoded completion texts
    columns: dict[str, list]  # the dataset's other columns, aligned with the rows
    raw_prompts: list[Any]  # the dataset's prompts: texts, or lists of messages
    completion_ids: Optional[list[list[int]]] = None

    def __len__(self) -> int:
        return len(self.completions)

    def conversational(self) -> bool:
        return bool(self.raw_prompts) and isinstance(self.raw_prompts[0], list)

    def trl_completions(self) -> list[Any]:
        if self.conversational():
            return [[{"role": "assistant", "content": c}] for c in self.completions]
        return list(self.completions)

    def slice(self, s: int, e: int) -> "Rows":
        ids = self.completion_ids[s:e] if self.completion_ids is not None else None
        return Rows(self.prompts[s:e], self.completions[s:e], {k: v[s:e] for k, v in self.columns.items()},
                    self.raw_prompts[s:e], ids)


def call_style(fn: Callable, requested: str, registered: bool) -> str:
    """``trl`` or ``plain`` for ``style: requested`` (see the module docstring)."""
    if requested != "auto":
        return requested
    if registered:
        return "plain"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin): call it the way TRL would
        return "trl"
    named = params.get("completions") or params.get("completion_ids")  # TRL's factory rewards take ids only
    if named is params.get("completion_ids") and "prompts" in params:
        named = None
    return "trl" if named is not None and named.kind is not inspect.Parameter.POSITIONAL_ONLY else "plain"


def keyword_arguments(fn: Callable, given: dict[str, Any]) -> dict[str, Any]:
    """``given``, or only the names ``fn`` declares when it takes no ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        return given
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return given
    return {k: v for k, v in given.items() if k in params}


def binding_problem(fn: Callable, style: str, columns: list[str], kwargs: dict[str, Any]) -> Optional[str]:
    """Why calling ``fn`` the way :class:`FunctionCall` does, with a dataset of these ``columns``, would fail on
    every row (a missing column, a column clashing with a parameter), or None. Binds, never calls."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check
        return None
    for name in columns:  # a list where it takes one value: every row would fail (or be misread)
        p = sig.parameters.get(name)
        if p is not None and p.default is not inspect.Parameter.empty and p.default is not None:
            return (f"the column {name!r} would be passed as its setting {name!r} (default {p.default!r}), a list "
                    f"of the rows' values where it takes one value")
    cols = {c: [] for c in columns}
    try:
        if style == "plain":
            sig.bind([], [], **cols, **kwargs)
        else:
            given = {"prompts": [], "completions": [], "completion_ids": [], "trainer_state": None, **cols, **kwargs}
            sig.bind(**keyword_arguments(fn, given))
    except TypeError as e:
        return str(e)
    return None


def send_by_value(fn: Callable, name: str) -> bytes:
    """A Python function given to the run (the Python API: a notebook's function, a lambda, a closure) as bytes
    a worker process turns back into it: dill pickles what cannot be imported by name (``__main__``'s functions,
    lambdas, closures and the globals they use) by value. ConfigError when it cannot be sent."""
    import io
    import sys

    import dill  # through datasets: pickle's by-value successor for functions

    class Sender(dill.Pickler):
        def persistent_id(self, obj):  # every object on the way: an open file is refused, not re-opened
            if isinstance(obj, io.IOBase) and obj not in (sys.stdin, sys.stdout, sys.stderr):
                raise TypeError(f"it holds an open file ({getattr(obj, 'name', obj)!r}, mode "
                                f"{getattr(obj, 'mode', '?')!r}), which a worker would open again (truncating a file "
                                f"open for writing) and whose writes it would make in its own process")
            return None

    try:
        out = io.BytesIO()
        Sender(out, recurse=True).dump(fn)
        return out.getvalue()
    except Exception as e:  # noqa: BLE001 - whatever the function holds that cannot be pickled
        raise ConfigError(f"the reward function {name!r} cannot be sent to the reward workers ({type(e).__name__}: "
                          f"{e}): run it in the trainer process with isolation: inline on its entry, or define it in "
                          f"a module and name it as 'package.module:function'") from e


_RECEIVED: dict[bytes, Callable] = {}  # a worker's functions received by value, by their bytes


def received_by_value(code: bytes) -> Callable:
    fn = _RECEIVED.get(code)
    if fn is None:
        import dill

        fn = _RECEIVED[code] = dill.loads(code)
    return fn


@dataclass
class FunctionCall:
    """One call of one reward function on a chunk of rows; picklable, so the worker pool can run it
    (``run``) or the trainer process can (``start`` then ``finish``, which lets async ones run together)."""

    fn: str  # a registered name or ``pkg.module:function`` (resolved where it runs)
    style: str  # trl | plain
    kwargs: dict[str, Any]
    rows: Rows
    state: StepInfo
    timeout: Optional[float] = None  # seconds (the pool's deadline; an inline async call's wait_for)
    code: Optional[bytes] = None  # the function by value (:func:`send_by_value`): one a worker cannot import

    def start(self) -> Any:
        """The function's return value: a list, or a coroutine for an async function."""
        fn, r = (received_by_value(self.code) if self.code is not None else REWARDS.get(self.fn)), self.rows
        if self.style == "plain":
            return fn(r.prompts, r.completions, **r.columns, **self.kwargs)
        given = {"prompts": r.raw_prompts, "completions": r.trl_completions(), "completion_ids": r.completion_ids,
                 "trainer_state": self.state, **r.columns, **self.kwargs}
        return fn(**keyword_arguments(fn, given))

    def finish(self, out: Any) -> Outcome:
        try:  # ``metrics``: a function's own counts (rewards/code_tests.py's Scores), logged by CombinedReward
            return Outcome("ok", values=checked_values(self.fn, out, len(self.rows)), value=getattr(out, "metrics", None))
        except Exception:  # noqa: BLE001 - a wrong answer of user code is an error outcome
            return Outcome("error", error=traceback.format_exc())

    def run(self) -> Outcome:
        """Here, to the end (a worker process, or an inline sync function)."""
        try:
            out = self.start()
            if inspect.isawaitable(out):
                out = asyncio.run(_bounded(out, self.timeout))
        except asyncio.TimeoutError:
            return Outcome("timeout")
        except Exception:  # noqa: BLE001 - any failure of user code is reported, counted and scored 0
            return Outcome("error", error=traceback.format_exc())
        return self.finish(out)


async def _bounded(coro: Any, timeout: Optional[float]) -> Any:
    return await (asyncio.wait_for(coro, timeout) if timeout else coro)


def run_inline(calls: list[FunctionCall]) -> list[Outcome]:
    """Calls in this process: sync ones one after another, async ones all at once in one event loop."""
    outcomes: list[Optional[Outcome]] = [None] * len(calls)
    pending: dict[int, Any] = {}
    for i, c in enumerate(calls):
        try:
            out = c.start()
        except Exception:  # noqa: BLE001
            outcomes[i] = Outcome("error", error=traceback.format_exc())
            continue
        if inspect.isawaitable(out):
            pending[i] = out
        else:
            outcomes[i] = c.finish(out)
    if pending:
        async def gather() -> list[Any]:
            return await asyncio.gather(*(_bounded(co, calls[i].timeout) for i, co in pending.items()),
                                        return_exceptions=True)

        for i, res in zip(pending, asyncio.run(gather())):
            if isinstance(res, asyncio.TimeoutError):
                outcomes[i] = Outcome("timeout")
            elif isinstance(res, BaseException):
                text = "".join(traceback.format_exception(type(res), res, res.__traceback__))
                outcomes[i] = Outcome("error", error=text)
            else:
                outcomes[i] = calls[i].finish(res)
    return outcomes  # type: ignore[return-value]


def checked_values(fn: str, out: Any, n: int) -> list[Optional[float]]:
    """The function's answer as floats (``None`` kept: the row is not scored by it); a wrong count or a value
    that is neither ``None`` nor a number finite in float32 is an error (one nan or inf would make a whole
    group's advantages nan)."""
    values = list(out)
    if len(values) != n:
        raise ValueError(f"reward {fn!r} returned {len(values)} values for {n} completions")
    floats = [None if v is None else float(v) for v in values]
    bad = [i for i, v in enumerate(floats) if v is not None and not abs(v) <= FLOAT32_MAX]
    if bad:
        raise ValueError(
            f"reward {fn!r} returned {floats[bad[0]]} for row {bad[0]} of its chunk ({len(bad)} of {n} "
            f"values not finite in float32, the rewards' dtype in the trainer: |r| <= 3.4e38): a reward must be a "
            f"finite number, or None to skip a row; the chunk scores 0"
        )
    return floats


def fix_hint(error: str, style: str, columns: list[str]) -> str:
    """What to change, guessed from a reward function's traceback."""
    last = error.strip().splitlines()[-1] if error and error.strip() else ""
    call = ("it is called as fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) "
            if style == "trl" else "it is called as fn(prompts, completions, **columns) ")
    if "missing" in last and "required" in last:
        return (f"the function needs an argument the call does not give ({last}): {call}where the columns are the "
                f"dataset's {columns} (map a column with data.columns, or give a fixed value with kwargs:)")
    if "unexpected keyword argument" in last or "positional argument" in last or "multiple values" in last:
        return (f"the function's signature does not fit the call: {call}with the dataset's columns {columns}; "
                "accept **kwargs, or set style: plain / style: trl on the rewards entry (docs/rewards.md)")
    if last.startswith("KeyError") or "missing" in last:
        return (f"a column it needs may be missing: the dataset's columns are {columns} (map yours with "
                "data.columns, or pass fixed values with kwargs:)")
    if "timeout" in last.lower() or not last:
        return "raise the entry's timeout (or reward_pool.timeout), or make the function faster"
    return "fix the function (its traceback is above), or try it on a few rows by hand"
