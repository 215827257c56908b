"""Tool calls in sandboxed worker processes: grpo/workers/worker_pool.py's pool (own process per worker, a hard
timeout per call, a hung worker killed and replaced, exceptions returned as tracebacks).

A :class:`ToolBox` is what an environment gets: ``call(name, args) -> ToolResult``. A call that
raises, passes ``timeout`` seconds, or returns something that is not a string of at most
``max_output_chars`` characters is a failed call (``ok`` false): it is counted and the environment
decides what that trajectory sees; the run goes on. Only the tool's name, its kwargs and the
argument text cross the process boundary.
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from grpo.workers.worker_pool import Outcome, WarmUp, WorkerPool, clip_text

log = logging.getLogger("tools")


@dataclass
class ToolCall:
    """One call of tool ``fn`` (a registered name or ``pkg.mod:function``) on ``args`` (runs in a worker)."""

    fn: str
    kwargs: dict[str, Any]
    args: str
    max_output_chars: int = 2000

    def run(self) -> Outcome:
        from grpo.foundation.plugins import TOOLS

        try:
            out = TOOLS.get(self.fn)(self.args, **self.kwargs)
            if not isinstance(out, str):
                raise TypeError(f"tool {self.fn!r} returned {type(out).__name__}, not str")
            if len(out) > self.max_output_chars:
                raise ValueError(f"tool {self.fn!r} returned {len(out)} characters (limit {self.max_output_chars})")
            return Outcome("ok", value=out)
        except Exception:  # noqa: BLE001 - any failure of the tool is this call's, reported back
            # bounded like an answer: a huge exception text neither crosses the pipe nor floods the log
            return Outcome("error", error=clip_text(traceback.format_exc(), max(self.max_output_chars, 500)))


@dataclass
class ToolResult:
    ok: bool
    output: Optional[str] = None  # the tool's answer when ok
    status: str = "ok"  # ok | error | timeout
    error: Optional[str] = None


@dataclass
class ToolBox:
    """The tools of one run (name -> (spec, kwargs)), one worker pool shared by all environments."""

    tools: dict[str, tuple[str, dict]]
    num_workers: int = 1
    timeout: float = 5.0
    max_output_chars: int = 2000
    limits: Any = None  # WorkerLimits of each tool worker (env.tool_limits)
    counts: dict[str, float] = field(default_factory=lambda: {"tool_calls": 0.0, "tool_errors": 0.0,
                                                               "tool_timeouts": 0.0})

    def __post_init__(self) -> None:
        # every new worker imports the tools' modules first (a replaced one too), under the pool's start-up
        # allowance, so that importing a tool never counts against a call's timeout
        warm = WarmUp(sorted({spec for spec, _ in self.tools.values()}), registry="TOOLS",
                      imports=(ToolCall.__module__,))
        self.pool = WorkerPool(self.num_workers, self.timeout, self.limits, warm_up=warm) if self.tools else None
        self._reported: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # environments of a turn may call tools from several threads

    def call(self, name: str, args: str) -> ToolResult:
        if name not in self.tools:
            raise KeyError(f"no tool named {name!r}; this run has {sorted(self.tools)} (env.tools)")
        return self.call_many([(name, args)])[0]

    def call_many(self, calls: list[tuple[str, str]]) -> list[ToolResult]:
        """Several calls at once, spread over the workers."""
        jobs = [ToolCall(self.tools[n][0], self.tools[n][1], str(a), self.max_output_chars) for n, a in calls]
        out = []
        for (name, _), o in zip(calls, self.pool.run(jobs) if jobs else []):
            with self._lock:
                self.counts["tool_calls"] += 1
                if o.status != "ok":
                    self.counts["tool_timeouts" if o.status == "timeout" else "tool_errors"] += 1
                    first = (name, o.status) not in self._reported
                    self._reported.add((name, o.status))
            if o.status == "ok":
                out.append(ToolResult(True, o.value))
                continue
            if first:
                log.warning("tool %r: %s (later ones are only counted)\n%s", name, o.status, o.error or "")
            out.append(ToolResult(False, None, o.status, o.error))
        return out

    def pop_counts(self) -> dict[str, float]:
        """Calls, errors and timeouts since the last pop, and ``tool_killed``: tool workers replaced for going
        past ``env.tool_limits`` (memory, CPU seconds) or crashing."""
        with self._lock:
            out = dict(self.counts)
            self.counts = {k: 0.0 for k in self.counts}
        out["tool_killed"] = float(sum(self.pool.pop_kills().values())) if self.pool is not None else 0.0
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
