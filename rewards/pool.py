"""Reward calls in worker processes, with a hard per-call timeout.

Reward code is untrusted in the sense that matters for a long run: math-verify can hang
on pathological input (sympy stuck inside one C call that no signal interrupts), a user
function can raise or be slow. So each call (one chunk of completions for one function)
runs in a worker process; a call that passes its deadline is answered with a timeout
and its worker is killed and replaced, and an exception comes back as its traceback.
A value that is not a finite number (nan, inf) is an error too: one nan would make its
whole group's advantages nan. The caller turns errors and timeouts into zeros and counts
them (rewards.CombinedReward).

Each worker runs under resource limits (``reward_pool.limits`` / ``env.tool_limits``, :func:`apply_limits`):
address space and file size for its life, CPU seconds per call (re-armed before each call). An allocation past
the memory limit raises MemoryError in the call (an error; the worker is replaced after it), a call past its
CPU seconds is killed by the kernel (SIGXCPU; the worker is replaced); both are counted in ``kills``.

Workers are started with ``spawn`` (a fork of a process holding torch's thread pools can
deadlock) and resolve functions by name themselves, so only names, kwargs and texts
cross the process boundary.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import resource
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Optional


@dataclass
class Call:
    """One reward call: function ``fn`` (registered name or ``pkg.mod:fn``) on a chunk of rows."""

    fn: str
    kwargs: dict[str, Any]
    prompts: list[str]
    completions: list[str]
    columns: dict[str, list]


MAX_ERROR_CHARS = 8000  # an error's text crosses the pipe and reaches the log: a huge exception message is cut


def clip_text(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: a line longer than a third of it keeps its ends (the start of a
    traceback's last line names the error), then the text keeps its head and its tail."""
    if len(text) <= limit:
        return text
    part = max(8, limit // 6)
    text = "\n".join(line if len(line) <= 2 * part else f"{line[:part]} [... {len(line) - 2 * part} cut ...] "
                     f"{line[-part:]}" for line in text.split("\n"))
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    head = max(0, (limit - len(note)) // 2)
    return text[:head] + note + text[len(text) - max(0, limit - len(note) - head):]


@dataclass
class Outcome:
    """``status`` is ok | error | timeout; ``values`` only when ok, ``error`` (a traceback, at most
    MAX_ERROR_CHARS, cut where it is made: in the worker) when error."""

    status: str
    values: Optional[list[float]] = None
    error: Optional[str] = None
    value: Any = None  # the answer of a call that runs itself (a tool call: envs/sandbox.py)

    def __post_init__(self) -> None:
        if isinstance(self.error, str) and len(self.error) > MAX_ERROR_CHARS:
            self.error = clip_text(self.error, MAX_ERROR_CHARS)


def dispatch(call: Any) -> Outcome:
    """A reward :class:`Call`, or any picklable object with ``run() -> Outcome`` (a tool call)."""
    return call.run() if hasattr(call, "run") else run_call(call)


def run_call(call: Call) -> Outcome:
    """Run one call here, in this process; an exception becomes an error outcome."""
    from rewards import resolve  # late: the worker process imports the registry itself

    try:
        fn = resolve(call.fn)
        values = [float(v) for v in fn(call.prompts, call.completions, **call.columns, **call.kwargs)]
        if len(values) != len(call.completions):
            raise ValueError(f"reward {call.fn!r} returned {len(values)} values for {len(call.completions)} completions")
        _check_finite(call.fn, values)
        return Outcome("ok", values=values)
    except Exception:  # noqa: BLE001 - any failure of user code scores 0 and is reported
        return Outcome("error", error=traceback.format_exc())


def _check_finite(fn: str, values: list[float]) -> None:
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(
            f"reward {fn!r} returned {values[bad[0]]} for row {bad[0]} of its chunk ({len(bad)} of {len(values)} "
            f"values not finite): a reward must be a finite number; the chunk scores 0"
        )


def apply_limits(limits: Optional[dict[str, int]]) -> None:
    """RLIMIT_AS (``memory_mb``) and RLIMIT_FSIZE (``file_size_mb``) of this process; 0 or missing = none."""
    mb = 1024 * 1024
    for key, which in (("memory_mb", resource.RLIMIT_AS), ("file_size_mb", resource.RLIMIT_FSIZE)):
        if limits and limits.get(key):
            resource.setrlimit(which, (limits[key] * mb, resource.getrlimit(which)[1]))


def _arm_cpu(seconds: int) -> None:
    """Let the next call use ``seconds`` more CPU seconds (the soft RLIMIT_CPU: SIGXCPU past it)."""
    if seconds:
        used = resource.getrusage(resource.RUSAGE_SELF)
        resource.setrlimit(resource.RLIMIT_CPU, (int(used.ru_utime + used.ru_stime) + seconds + 1,
                                                 resource.getrlimit(resource.RLIMIT_CPU)[1]))


def _worker_main(conn: Connection, limits: Optional[dict[str, int]] = None) -> None:
    """Worker loop: apply the limits, import the registry, say ready, then receive a Call and send back its
    Outcome until None or a closed pipe."""
    apply_limits(limits)
    import rewards  # noqa: F401  (slow imports happen before the first deadline starts)

    conn.send("ready")
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if call is None:
            return
        _arm_cpu((limits or {}).get("cpu_seconds", 0))
        try:
            out = dispatch(call)
        except MemoryError:  # raised outside the call's own handler (its traceback could not be built)
            out = Outcome("error", error="MemoryError (reward_pool.limits.memory_mb)")
        conn.send(out)


class _Worker:
    STARTUP_TIMEOUT = 300.0  # seconds for a new worker's imports

    def __init__(self, ctx, limits: Optional[dict[str, int]] = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, limits), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        """Block until the worker has imported the registry (not counted against any call's timeout)."""
        if self.ready:
            return
        if not self.conn.poll(self.STARTUP_TIMEOUT):
            raise RuntimeError(f"reward worker did not start within {self.STARTUP_TIMEOUT:.0f} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"reward worker died while starting (exit code {self.proc.exitcode})") from e
        if msg != "ready":
            raise RuntimeError(f"reward worker sent {msg!r} instead of 'ready'")
        self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """``num_workers`` processes; :meth:`run` maps calls to outcomes, each call within ``timeout`` seconds
    (or its own ``timeout`` attribute when it has one).

    ``num_workers=0`` runs calls in this process, one after another, without a timeout or limits
    (for debugging: nothing can interrupt a hung call there). ``limits``: a WorkerLimits (or mapping) for
    each worker; ``kills`` counts workers replaced for memory, cpu, or another crash.
    """

    def __init__(self, num_workers: int, timeout: float, limits: Any = None):
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0")
        self.num_workers, self.timeout = num_workers, timeout
        self._ctx = mp.get_context("spawn")
        self.limits = limits if limits is None or isinstance(limits, dict) else dict(vars(limits))
        self._workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash
        self.kills = {"memory": 0, "cpu": 0, "crash": 0}  # workers replaced for going past a limit, or dying
        if num_workers:
            self._workers = [_Worker(self._ctx, self.limits) for _ in range(num_workers)]
            atexit.register(self.close)

    def run(self, calls: list[Call]) -> list[Outcome]:
        if not self.num_workers:
            return [dispatch(c) for c in calls]
        results: list[Optional[Outcome]] = [None] * len(calls)
        queue = deque(range(len(calls)))
        idle = list(range(len(self._workers)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, deadline)
        while queue or busy:
            while queue and idle:
                slot, i = idle.pop(), queue.popleft()
                try:
                    self._workers[slot].wait_ready()
                    self._workers[slot].conn.send(calls[i])
                except (BrokenPipeError, OSError, RuntimeError):  # died while idle: replace it, retry once
                    self._replace(slot)
                    self._workers[slot].wait_ready()
                    self._workers[slot].conn.send(calls[i])
                busy[slot] = (i, time.monotonic() + (getattr(calls[i], "timeout", None) or self.timeout))
            now = time.monotonic()
            wait_for = max(0.0, min(d for _, d in busy.values()) - now)
            ready = wait([self._workers[s].conn for s in busy], timeout=wait_for)
            for slot in list(busy):
                w, (i, deadline) = self._workers[slot], busy[slot]
                if w.conn in ready:
                    try:
                        results[i] = w.conn.recv()
                        if results[i].status == "error" and "MemoryError" in (results[i].error or ""):
                            self.kills["memory"] += 1  # its heap may be fragmented or hold the garbage: a fresh one
                            self._replace(slot)
                    except (EOFError, OSError):  # the worker crashed mid-call (segfault, OOM kill, SIGXCPU)
                        w.proc.join(timeout=5)
                        code = w.proc.exitcode
                        cpu = code == -signal.SIGXCPU
                        self.kills["cpu" if cpu else "crash"] += 1
                        why = " past reward_pool.limits.cpu_seconds / env.tool_limits.cpu_seconds" if cpu else ""
                        results[i] = Outcome("error", error=f"worker process died (exit code {code}){why}")
                        self._replace(slot)
                elif time.monotonic() >= deadline:
                    results[i] = Outcome("timeout")
                    self._replace(slot)
                else:
                    continue
                del busy[slot]
                idle.append(slot)
        return results  # type: ignore[return-value]

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self.limits)
        self.restarts += 1

    def pop_kills(self) -> dict[str, int]:
        out, self.kills = self.kills, dict.fromkeys(self.kills, 0)
        return out

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
