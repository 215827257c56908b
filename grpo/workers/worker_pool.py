"""The worker pool: reward functions and environments' tools (grpo/workers/tools.py) run in worker processes, with a
hard per-call timeout.

Reward and tool code is untrusted in the sense that matters for a long run: math-verify can hang
on pathological input (sympy stuck inside one C call that no signal interrupts), a user
function can raise or be slow. So each call (one chunk of completions for one function)
runs in a worker process; a call that passes its deadline is answered with a timeout
and its worker is killed and replaced, and an exception comes back as its traceback.
A value that is not a finite number (nan, inf) is an error too: one nan would make its
whole group's advantages nan. The caller turns errors and timeouts into zeros and counts
them (grpo/scoring/combined.py's CombinedReward).

Each worker runs under resource limits (``reward_pool.limits`` / ``env.tool_limits``, :func:`apply_limits`):
address space and file size for its life, CPU seconds per call (re-armed before each call). An allocation past
the memory limit raises MemoryError in the call (an error; the worker is replaced after it), a call past its
CPU seconds is killed by the kernel (SIGXCPU; the worker is replaced); both are counted in ``kills``.

Workers are forked by multiprocessing's ``forkserver``: a clean process started once (a fork of a process holding
torch's thread pools can deadlock), which has imported the registry, so a new or replaced worker skips a fresh
interpreter's start and the registry's import (0.3-0.5 s of CPU each); unlike multiprocessing's default, it does
not run the main script's top level again (``_without_main``). Workers resolve functions by name themselves, so only names, kwargs and
texts cross the process boundary.

What comes back is data, never a pickle: code running in a worker (a reward or tool that runs model-written
code) can write into the pipe, so an answer is JSON of at most MAX_ANSWER_BYTES carrying the number of the call
it answers, read against the call's deadline (:func:`read_answer`). Anything else (a pickle, garbage, a huge
length prefix, a stray or late message) is that call's error and its worker is replaced.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import select
import struct
import multiprocessing as mp
import resource
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Iterator, Optional


log = logging.getLogger("rewards")


# what a worker imports before it says ready (the forkserver too): the registries (the module of the calls it runs:
# its WarmUp's imports)
PRELOAD = ("grpo.foundation.plugins",)

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
    value: Any = None  # the answer of a call that runs itself (a tool call: grpo/workers/tools.py)
    tainted: Optional[str] = None  # what the call patched in its worker (the worker is replaced)

    def __post_init__(self) -> None:
        if isinstance(self.error, str) and len(self.error) > MAX_ERROR_CHARS:
            self.error = clip_text(self.error, MAX_ERROR_CHARS)


@dataclass
class WarmUp:
    """A new worker's first call, before any deadline (the pool's start-up allowance): imports ``imports`` (the
    module of the calls it will run), resolves the run's functions by name in ``registry`` (one of
    grpo/foundation/plugins.py's), which imports their modules, and imports what each lists in its
    ``slow_imports`` (math_correct: math-verify), so that no call's timeout pays for an import. A function that
    cannot be resolved is left to its real call to report."""

    fns: list[str]
    registry: str = "REWARDS"  # or TOOLS
    imports: tuple[str, ...] = ()

    def run(self) -> Outcome:
        from grpo.foundation import plugins

        for name in self.imports:
            importlib.import_module(name)
        resolve = getattr(plugins, self.registry).get
        for fn in self.fns:
            try:
                for name in getattr(resolve(fn), "slow_imports", ()):
                    importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the real call will report it
                pass
        return Outcome("ok")


def dispatch(call: Any) -> Outcome:
    """Any picklable object with ``run() -> Outcome``: a reward's FunctionCall, a tool call, a WarmUp."""
    return call.run()


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


MAX_ANSWER_BYTES = 64 << 20  # one answer's JSON; a longer one (or a longer length prefix) is refused unread


def snapshot_functions(seen: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    """Add to ``seen`` every loaded module not in it yet, with the functions and classes it binds."""
    for name, mod in list(sys.modules.items()):
        if name in seen or mod is None:
            continue
        try:
            d = vars(mod)
        except TypeError:
            continue
        seen[name] = (mod, {k: v for k, v in list(d.items()) if callable(v)})


def patched(seen: dict[str, tuple[Any, dict[str, Any]]]) -> Optional[str]:
    """The first function or class a call rebound in a loaded module (builtins included), or None. A call that
    patched one (math_verify.verify = ..., builtins.float = ...) would change every later call in its worker
    (a wrong completion then scored 1.0): such a worker is replaced. Flags and caches (not callables) may
    change freely."""
    for name, (mod, funcs) in seen.items():
        if sys.modules.get(name, mod) is not mod:
            return f"the module {name}"
        d = vars(mod)
        for k, v in funcs.items():
            if d.get(k) is not v:
                return f"{name}.{k}"
    return None


def encode_answer(seq: int, out: Outcome, tainted: Optional[str] = None) -> bytes:
    """An Outcome as the JSON the trainer accepts (answering call number ``seq``); ``tainted``: what the call
    patched in the worker (it is replaced after this answer)."""
    body = {"seq": seq, "status": out.status, "values": out.values, "error": out.error, "value": out.value,
            "tainted": tainted}
    try:
        return json.dumps(body).encode()
    except (TypeError, ValueError) as e:  # a value JSON cannot carry (an object): the call's error
        return json.dumps({"seq": seq, "status": "error", "values": None, "value": None,
                           "error": f"the call's answer cannot be sent back as JSON ({e})"}).encode()


def decode_answer(raw: bytes, seq: int) -> Outcome:
    """The Outcome in ``raw``; ValueError unless it is JSON answering call ``seq`` in the expected shape."""
    try:
        d = json.loads(raw)
    except RecursionError as e:  # not a ValueError: it would leave the step
        raise ValueError(f"not the answer to call {seq}: JSON nested too deeply") from e
    if not isinstance(d, dict) or d.get("seq") != seq or d.get("status") not in ("ok", "error", "timeout"):
        raise ValueError(f"not the answer to call {seq}: {raw[:80]!r}")
    values, error = d.get("values"), d.get("error")
    if values is not None and not (isinstance(values, list) and all(v is None or isinstance(v, (int, float))
                                                                     and not isinstance(v, bool) for v in values)):
        raise ValueError(f"values of call {seq} are not numbers")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"error of call {seq} is not text")
    tainted = d.get("tainted")
    return Outcome(d["status"], values=values, error=error, value=d.get("value"),
                   tainted=tainted if isinstance(tainted, str) else None)


def read_answer(conn: Connection, deadline: float, limit: int = MAX_ANSWER_BYTES) -> bytes:
    """One message of ``conn`` (multiprocessing's framing: a 4-byte length, or -1 and an 8-byte one) read
    before ``deadline`` (time.monotonic()): TimeoutError past it, ValueError for a length over ``limit``,
    EOFError when the worker closed the pipe. Never blocks past the deadline on a message sent in part."""
    fd = conn.fileno()

    def read(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the answer did not arrive whole before its deadline ({len(buf)} of {n} bytes)")
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the worker closed the pipe")
            buf += chunk
        return buf

    (n,) = struct.unpack("!i", read(4))
    if n == -1:
        (n,) = struct.unpack("!Q", read(8))
    if not 0 <= n <= limit:
        raise ValueError(f"an answer of {n} bytes (at most {limit})")
    return read(n)


def _worker_main(conn: Connection, limits: Optional[dict[str, int]] = None) -> None:
    """Worker loop: apply the limits, import the registry, say ready, then receive (number, call) and send back
    its Outcome as JSON (:func:`encode_answer`) until None or a closed pipe. The worker leads a session (and
    process group) of its own: what its calls start is killed with it, and a signal to "its" group never
    reaches the trainer's."""
    try:
        os.setsid()
    except OSError:  # already a group leader
        pass
    apply_limits(limits)
    for module in PRELOAD:  # slow imports happen before the first deadline starts
        importlib.import_module(module)

    conn.send_bytes(b"ready")
    seen: dict[str, tuple[Any, dict[str, Any]]] = {}
    snapshot_functions(seen)
    while True:
        try:
            job = conn.recv()  # from the trainer: trusted
        except (EOFError, OSError):
            return
        if job is None:
            return
        seq, call = job
        _arm_cpu((limits or {}).get("cpu_seconds", 0))
        try:
            out = dispatch(call)
        except MemoryError:  # raised outside the call's own handler (its traceback could not be built)
            out = Outcome("error", error="MemoryError (reward_pool.limits.memory_mb)")
        tainted = patched(seen)
        snapshot_functions(seen)  # modules the call imported: watched from now on
        conn.send_bytes(encode_answer(seq, out, tainted))


def _context(imports: tuple[str, ...] = ()):
    """The forkserver context whose server has imported the registry and ``imports`` (the module of the first
    pool's calls; set before the server starts: the preload of a server already running stays as it was, and a
    worker imports its calls' module in its WarmUp). Workers are started without the main script (see
    :func:`_without_main`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *imports])
    return ctx


_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start processes without multiprocessing's re-run of the main script in each of them. A user's script that
    calls ``grpo.train`` at its top level, without ``if __name__ == "__main__":`` (a notebook cell saved as a
    file), ran again in every worker: each started another run. Workers need nothing of the main script: they
    import what they run by name, and the Python API's functions reach them by value (grpo/scoring/calls.py)."""
    from multiprocessing import spawn

    real = spawn.get_preparation_data

    def without(name: str) -> dict:
        data = real(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _START_LOCK:
        spawn.get_preparation_data = without
        try:
            yield
        finally:
            spawn.get_preparation_data = real


class _Worker:
    STARTUP_TIMEOUT = 300.0  # seconds for a new worker's imports
    STOP_WAIT_S = 2.0  # seconds a started worker has to leave when stopped (then it is killed)

    def __init__(self, ctx, limits: Optional[dict[str, int]] = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, limits), daemon=True)
        with _without_main():
            self.proc.start()
        child.close()
        self.ready = False
        self.warmed = False  # the pool's warm_up call has run here

    def wait_ready(self) -> None:
        """Block until the worker has imported the registry (not counted against any call's timeout)."""
        if self.ready:
            return
        try:
            msg = read_answer(self.conn, time.monotonic() + self.STARTUP_TIMEOUT, limit=64)
        except TimeoutError as e:
            raise RuntimeError(f"reward worker did not start within {self.STARTUP_TIMEOUT:.0f} s") from e
        except (EOFError, OSError, ValueError) as e:
            raise RuntimeError(f"reward worker died while starting (exit code {self.proc.exitcode})") from e
        if msg != b"ready":
            raise RuntimeError(f"reward worker sent {msg[:80]!r} instead of 'ready'")
        self.ready = True

    def _kill_group(self) -> None:
        """SIGKILL to the worker's process group: the worker and whatever its calls started (a child outliving
        a timed-out call was reparented to init and kept running, also after close())."""
        if self.proc.pid is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        self._kill_group()
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def started(self) -> bool:
        """Whether the worker has said it is ready (its message read now, without waiting, if it is there)."""
        if not self.ready and self.conn.poll(0):
            try:
                self.wait_ready()
            except RuntimeError:
                return False
        return self.ready

    def ask_to_stop(self) -> None:
        """A started worker is asked to leave (after the call it may be running); one still importing holds no
        work and is killed at once, instead of being waited for through its imports."""
        if not self.started():
            self._kill_group()
            self.proc.kill()
            return
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass

    def finish_stop(self, deadline: float) -> None:
        """Wait until ``deadline`` (time.monotonic()) for the worker to leave, then kill what is left."""
        self.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_group()  # the worker has left (or is killed now); what it started goes with it
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """``num_workers`` processes; :meth:`run` maps calls to outcomes, each call within ``timeout`` seconds
    (or its own ``timeout`` attribute when it has one).

    ``num_workers=0`` runs calls in this process, one after another, without a timeout or limits
    (for debugging: nothing can interrupt a hung call there). ``limits``: a WorkerLimits (or mapping) for
    each worker; ``kills`` counts workers replaced for memory, cpu, or another crash. ``warm_up``: a call each
    new worker runs before its first real one, under the start-up allowance (imports that must not count
    against a call's deadline).

    Thread-safe: several threads may call :meth:`run` at once (a turn's environments stepping concurrently);
    each takes idle workers as it needs them and gives them back as its calls finish, so N threads with one
    call each keep up to N workers busy.
    """

    POLL_S = 0.02  # while calls wait for a worker held by another thread: how often to look for a free one

    def __init__(self, num_workers: int, timeout: float, limits: Any = None, warm_up: Any = None):
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0")
        self.num_workers, self.timeout, self.warm_up = num_workers, timeout, warm_up
        self._ctx = _context(tuple(getattr(warm_up, "imports", ())))
        self.limits = limits if limits is None or isinstance(limits, dict) else dict(vars(limits))
        self._workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash
        self.kills = {"memory": 0, "cpu": 0, "crash": 0}  # workers replaced for going past a limit, or dying
        self._seq = 0  # the number of the last call sent: an answer must carry its call's
        self._reported_taint: set[str] = set()
        self._lock = threading.Condition()  # guards _idle, _seq and the counters
        self._idle: list[int] = []  # worker slots no run() holds
        if num_workers:
            self._workers = [_Worker(self._ctx, self.limits) for _ in range(num_workers)]
            self._idle = list(range(num_workers))
            atexit.register(self.close)

    # -- the slots a run() holds
    def _take(self, want: int, block: bool) -> list[int]:
        """Up to ``want`` idle slots; at least one when ``block`` (waiting for another thread to give one back)."""
        with self._lock:
            while block and not self._idle:
                self._lock.wait()
            taken, self._idle = self._idle[:want], self._idle[want:]
            return taken

    def _give(self, slots: list[int]) -> None:
        if slots:
            with self._lock:
                self._idle.extend(slots)
                self._lock.notify_all()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.kills[kind] += 1

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _ready(self, slot: int) -> None:
        """The worker in ``slot`` started and warmed up (``warm_up``, once per worker)."""
        w = self._workers[slot]
        w.wait_ready()
        if self.warm_up is not None and not w.warmed:
            w.warmed = True
            seq = self._next_seq()
            w.conn.send((seq, self.warm_up))
            try:
                decode_answer(read_answer(w.conn, time.monotonic() + w.STARTUP_TIMEOUT), seq)
            except (TimeoutError, EOFError, OSError, ValueError):
                pass  # a broken worker: the real call finds it and reports it

    def _send(self, slot: int, call: Any) -> int:
        seq = self._next_seq()
        try:
            self._ready(slot)
            self._workers[slot].conn.send((seq, call))
        except (BrokenPipeError, OSError, RuntimeError):  # died while idle: replace it, retry once
            self._replace(slot)
            self._ready(slot)
            self._workers[slot].conn.send((seq, call))
        return seq

    def run(self, calls: list[Any]) -> list[Outcome]:
        if not self.num_workers:
            return [dispatch(c) for c in calls]
        results: list[Optional[Outcome]] = [None] * len(calls)
        queue = deque(range(len(calls)))
        idle: list[int] = []  # slots this run holds with nothing sent
        busy: dict[int, tuple[int, float, int]] = {}  # worker slot -> (call index, deadline, call number)
        try:
            while queue or busy:
                others = len(busy) + len(idle) < self.num_workers  # another thread holds some workers
                if len(queue) > len(idle) and others:
                    idle += self._take(len(queue) - len(idle), block=not busy and not idle)
                while queue and idle:
                    slot, i = idle.pop(), queue.popleft()
                    try:
                        seq = self._send(slot, calls[i])
                    except BaseException:  # a worker that cannot start: its slot goes back (finally), not lost
                        idle.append(slot)
                        raise
                    deadline = time.monotonic() + (getattr(calls[i], "timeout", None) or self.timeout)
                    busy[slot] = (i, deadline, seq)
                self._give(idle[len(queue):])  # what this run cannot use now, for the other threads
                del idle[len(queue):]
                now = time.monotonic()
                wait_for = max(0.0, min(d for _, d, _ in busy.values()) - now)
                if queue and len(busy) < self.num_workers:  # calls wait for a worker another thread holds
                    wait_for = min(wait_for, self.POLL_S)
                ready = wait([self._workers[s].conn for s in busy], timeout=wait_for)
                for slot in list(busy):
                    if self._collect(slot, busy[slot], calls, results, ready):
                        del busy[slot]
                        idle.append(slot)
        finally:
            for slot in busy:  # left mid-call (an exception here): its answer would reach the next caller
                self._replace(slot)
            self._give(idle + list(busy))
        return results  # type: ignore[return-value]

    def _collect(self, slot: int, job: tuple[int, float, int], calls: list, results: list, ready: list) -> bool:
        """The answer of the call in ``slot`` into ``results`` (its worker replaced when it must be); False
        while the call is still running within its deadline."""
        w, (i, deadline, seq) = self._workers[slot], job
        if w.conn in ready:
            try:
                results[i] = decode_answer(read_answer(w.conn, max(deadline, time.monotonic() + 1.0)), seq)
                if results[i].status == "error" and "MemoryError" in (results[i].error or ""):
                    self._count("memory")  # its heap may be fragmented or hold the garbage: a fresh one
                    self._replace(slot)
                elif results[i].tainted:  # later calls must not run on what this one patched
                    with self._lock:
                        first = results[i].tainted not in self._reported_taint
                        self._reported_taint.add(results[i].tainted)
                    if first:
                        log.warning("a call of %s rebound %s in its worker; the worker is replaced after "
                                    "such calls (later ones are not logged)",
                                    getattr(calls[i], "fn", "?"), results[i].tainted)
                    self._replace(slot)
            except TimeoutError:  # a message begun and never finished
                results[i] = Outcome("timeout")
                self._replace(slot)
            except ValueError as e:  # not an answer: code in the worker wrote into the pipe
                self._count("crash")
                results[i] = Outcome("error", error=f"the worker sent something that is not its answer ({e}); "
                                                    f"it was replaced")
                self._replace(slot)
            except (EOFError, OSError):  # the worker crashed mid-call (segfault, OOM kill, SIGXCPU)
                w.proc.join(timeout=5)
                code = w.proc.exitcode
                cpu = code == -signal.SIGXCPU
                self._count("cpu" if cpu else "crash")
                why = " past reward_pool.limits.cpu_seconds / env.tool_limits.cpu_seconds" if cpu else ""
                results[i] = Outcome("error", error=f"worker process died (exit code {code}){why}")
                self._replace(slot)
            return True
        if time.monotonic() >= deadline:
            results[i] = Outcome("timeout")
            self._replace(slot)
            return True
        return False

    def _replace(self, slot: int) -> None:
        """A new worker in ``slot`` (held by the caller's run, so no other thread touches it meanwhile)."""
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self.limits)
        with self._lock:
            self.restarts += 1

    def pop_kills(self) -> dict[str, int]:
        with self._lock:
            out, self.kills = self.kills, dict.fromkeys(self.kills, 0)
        return out

    def close(self) -> None:
        """Stop every worker: all are asked at once and share one wait (a worker still starting is killed)."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.ask_to_stop()
        deadline = time.monotonic() + _Worker.STOP_WAIT_S
        for w in workers:
            w.finish_stop(deadline)
