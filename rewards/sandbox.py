"""Running untrusted (model-written) code: one execution, one locked-down process group (docs/sandbox.md).

Used by the ``code_tests`` reward (rewards/code_tests.py) and the ``python`` tool (envs/tools.py). Each
:func:`run` starts a small launcher (rewards/_launch.py) with ``start_new_session`` (its own process group),
in a fresh temporary directory, with an empty environment and stdin closed (or given). The launcher, before
it ``exec`` s the program:

  - enters a new network namespace (``unshare(CLONE_NEWNET)``): no interface but a down loopback, so no
    connection anywhere, loopback included. Where the kernel or the container refuses, it is logged once
    and the program has the trainer's network (``sandbox.network: required`` makes that an error instead);
  - sets RLIMIT_AS (memory), RLIMIT_CPU (CPU seconds), RLIMIT_FSIZE (largest file), RLIMIT_NOFILE (open
    files), RLIMIT_NPROC (processes: no fork bomb), RLIMIT_CORE 0;
  - when running as root, drops to the unprivileged user ``sandbox.user`` (default ``nobody``): root is
    exempt from RLIMIT_NPROC and may write anywhere. It stays root only when that user does not exist or
    cannot execute the interpreter (a Python under /root): logged once, see :func:`capabilities`.

The parent reads stdout and stderr as they come, keeps at most ``max_output_bytes`` of each (a program that
writes more is killed: ``output_limit``), and kills the whole group (``os.killpg``) at the wall-clock
``timeout`` and after the program ends (stray children). The reason the run ended is one of
``ok | exit | timeout | cpu | memory | output_limit | signal | error`` (:class:`Result`).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("sandbox")

LAUNCHER = str(Path(__file__).with_name("_launch.py"))
_logged: set[str] = set()


@dataclass
class Limits:
    """The limits of one execution (the ``sandbox:`` config section, grpo/foundation/config.py)."""

    timeout: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    processes: int = 64
    max_output_bytes: int = 65536
    network: str = "auto"
    user: str = "nobody"
    python: str = ""

    @classmethod
    def of(cls, given: Any = None) -> "Limits":
        """From a Limits, a SandboxConfig, a mapping (a reward's or tool's ``sandbox`` kwarg) or None."""
        if given is None:
            return cls()
        if isinstance(given, cls):
            return given
        if not isinstance(given, dict):
            given = asdict(given)
        names = set(cls.__dataclass_fields__)
        bad = sorted(set(given) - names)
        if bad:
            raise ValueError(f"sandbox keys {bad} are unknown; valid: {sorted(names)}")
        return cls(**given)


@dataclass
class Result:
    """How one execution ended. ``reason``: ok (exit 0) | exit (another exit code) | timeout (wall clock) |
    cpu (RLIMIT_CPU) | memory (MemoryError or a failed allocation) | output_limit | signal (killed by another
    signal: a segfault, a kill) | error (the sandbox could not start it)."""

    reason: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def _log_once(key: str, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(msg)


def _world_executable(path: str) -> bool:
    """Whether a user other than the owner may execute ``path`` (every directory above it searchable)."""
    p = Path(path).resolve()
    try:
        if not os.stat(p).st_mode & 0o001:
            return False
        return all(os.stat(d).st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


@lru_cache(maxsize=None)
def _interpreter(python: str, user: str) -> tuple[str, Optional[tuple[int, int]]]:
    """(the interpreter to run, (uid, gid) to drop to or None)."""
    if os.geteuid() != 0 or not user:
        return python or sys.executable, None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        _log_once("user", f"sandbox: user {user!r} does not exist: untrusted code runs as root (no RLIMIT_NPROC, "
                          f"writes anywhere root can); create it or set sandbox.user")
        return python or sys.executable, None
    candidates = [python] if python else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    for c in candidates:
        if c and _world_executable(c):
            return c, (pw.pw_uid, pw.pw_gid)
    _log_once("python", f"sandbox: user {user!r} cannot execute {candidates[0]!r} (a directory above it is private): "
                        f"untrusted code runs as root; set sandbox.python to an interpreter others can run")
    return python or sys.executable, None


@lru_cache(maxsize=None)
def network_isolation() -> bool:
    """Whether this kernel/container lets a process enter a new network namespace (probed once)."""
    probe = subprocess.run([sys.executable, "-I", "-S", LAUNCHER, json.dumps({"network": "required"}), "--",
                            sys.executable, "-I", "-S", "-c", "pass"], capture_output=True, timeout=30)
    return probe.returncode == 0


def capabilities(limits: Any = None) -> dict[str, Any]:
    """What the sandbox can enforce here: ``network`` (own namespace), ``unprivileged`` (runs as a user other
    than the trainer's: it cannot write the trainer's files or read its private ones), ``python``."""
    lim = Limits.of(limits)
    python, ids = _interpreter(lim.python, lim.user)
    return {"network": network_isolation() if lim.network != "allowed" else False,
            "unprivileged": ids is not None or os.geteuid() != 0, "drops_user": ids is not None, "python": python}


def python_command(lim: Limits) -> list[str]:
    """The interpreter and its flags: isolated mode (no PYTHON* variables, no user site, no cwd on sys.path)."""
    return [_interpreter(lim.python, lim.user)[0], "-I", "-B"]


def run(argv: list[str], limits: Any = None, stdin: Optional[str] = None,
        files: Optional[dict[str, str]] = None) -> Result:
    """Run ``argv`` (``argv[0]`` = ``"python"`` means the sandbox's interpreter) in a fresh temporary directory
    holding ``files`` (name -> text), under ``limits``; ``stdin`` is its input (None: closed)."""
    lim = Limits.of(limits)
    python, ids = _interpreter(lim.python, lim.user)
    if argv and argv[0] == "python":
        argv = python_command(lim) + list(argv[1:])
    network = lim.network
    if network == "auto" and not network_isolation():
        _log_once("network", "sandbox: this kernel/container refuses a new network namespace (unshare "
                             "CLONE_NEWNET): untrusted code has the trainer's network (docs/sandbox.md)")
        network = "allowed"
    spec = {"memory_mb": lim.memory_mb, "cpu_seconds": lim.cpu_seconds, "file_size_mb": lim.file_size_mb,
            "open_files": lim.open_files, "processes": lim.processes, "network": network,
            "uid": ids[0] if ids else None, "gid": ids[1] if ids else None}
    work = tempfile.mkdtemp(prefix="sandbox-")
    try:
        for name, text in (files or {}).items():
            Path(work, name).write_text(text)
        if ids:
            for p in [work, *(str(Path(work, n)) for n in files or {})]:
                os.chown(p, *ids)
        cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec), "--", *argv]
        for attempt in range(4):
            result = _execute(cmd, work, lim, stdin)
            # the sandbox user's processes of a run just killed (a fork bomb) wait for init to reap them
            if not (result.reason == "error" and "Resource temporarily unavailable" in result.stderr):
                break
            time.sleep(0.5 * (attempt + 1))
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _execute(cmd: list[str], cwd: str, lim: Limits, stdin: Optional[str]) -> Result:
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env={}, start_new_session=True, close_fds=True,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        return Result("error", None, "", f"sandbox could not start: {e}", 0.0)
    if stdin is not None:
        try:  # small inputs fit the pipe; a program that never reads does not block us past the pipe size
            os.set_blocking(proc.stdin.fileno(), False)
            os.write(proc.stdin.fileno(), stdin.encode()[:65536])
        except (BlockingIOError, BrokenPipeError, OSError):
            pass
        proc.stdin.close()
    out = {"stdout": bytearray(), "stderr": bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    deadline = t0 + lim.timeout
    reason = None
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            buf = out[key.data]
            buf += chunk
            if len(buf) > lim.max_output_bytes:
                reason = "output_limit"
        if reason:
            break
    _kill_group(proc.pid)
    try:
        rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()) if reason is None else 5)
    except subprocess.TimeoutExpired:  # stdout closed but still running (it closed its own streams)
        reason = "timeout"
        _kill_group(proc.pid)
        rc = proc.wait(timeout=5)
    _kill_group(proc.pid, wait=2.0)  # anything it left behind in its group, gone before the next run
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    seconds = time.monotonic() - t0
    stdout = bytes(out["stdout"][:lim.max_output_bytes]).decode(errors="replace")
    stderr = bytes(out["stderr"][:lim.max_output_bytes]).decode(errors="replace")
    truncated = any(len(b) > lim.max_output_bytes for b in out.values())
    if reason is None:
        reason = _reason(rc, stderr)
    return Result(reason, rc, stdout, stderr, seconds, truncated)


def _reason(rc: int, stderr: str) -> str:
    if rc == 0:
        return "ok"
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and "cpu" in stderr[-200:].lower()):
        return "cpu"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if rc == 121:  # the launcher's own failure (see rewards/_launch.py)
        return "error"
    return "signal" if rc < 0 else "exit"


def _kill_group(pgid: int, wait: float = 0.0) -> None:
    """SIGKILL the group; with ``wait``, until no live process is left in it (zombies wait for init)."""
    end = time.monotonic() + wait
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() >= end or not _live_members(pgid):
            return
        time.sleep(0.01)


def _live_members(pgid: int) -> bool:
    if not os.path.isdir("/proc"):  # not Linux: no way to look; the group was SIGKILLed once
        return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] not in "ZX" and int(fields[2]) == pgid:
            return True
    return False


def run_python(code: str, limits: Any = None, stdin: Optional[str] = None) -> Result:
    """Run Python source ``code`` as ``main.py`` in the sandbox."""
    return run(["python", "main.py"], limits, stdin, {"main.py": code})
