"""Running untrusted (model-written) code: one execution, isolated from the trainer and from every other run
(docs/sandbox.md).

Used by the ``code_tests`` reward (rewards/code_tests.py) and the ``python`` tool (envs/tools.py). Each
:func:`run` starts a small launcher (grpo/workers/_launch.py) in a session of its own, in a fresh folder, with an
empty environment and stdin closed (or given), under the run's own cgroup where one can be made. Where the
kernel allows it (probed once, :func:`capabilities`):

  - its own PID namespace: the program's init reaps every orphan, and when the program ends or is killed,
    every process it started dies with it (``setsid`` daemons included); no zombie is left to the trainer;
  - its own mount namespace: a private root holding the system folders and the interpreter read-only, its own
    /proc, /dev, a private /tmp and /dev/shm (``tmp_mb`` each, gone with the run), and its run folder, the only
    writable path of the host; the trainer's run folder, data and code are not there;
  - its own network namespace: no interface but a down loopback (``network: auto``; ``allowed`` keeps the
    trainer's network; ``required`` refuses to run without one);
  - as root: a uid of its own per concurrent run (``uid_base`` + slot; ``user`` names one user for all
    instead), so RLIMIT_NPROC and file ownership are per run; as a plain user: a user namespace (the program
    has the trainer's uid outside, 65534 inside, and no capability), and RLIMIT_NPROC only where the kernel
    counts it per user namespace (Linux >= 5.14), never on the trainer's own uid;
  - a cgroup (v1 ``memory`` + ``pids`` or v2) with ``memory_mb`` and ``processes`` on the whole run;
  - per-process rlimits: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE 0.

Where a protection cannot be had it is said once, in :func:`describe`, which the trainer prints at start;
``isolation: required`` refuses to run without the namespaces instead. A run that cannot start (a namespace,
a mount, the fork or the exec refused) ends with reason ``error`` and the launcher's line in
:attr:`Result.error`: an infrastructure error, never the program's; callers raise :class:`SandboxError`.

The parent feeds stdin and reads stdout and stderr as they come, keeps at most ``max_output_bytes`` of each
(a program that writes more is killed: ``output_limit``), and kills the launcher's group at the wall-clock
``timeout``. The reason the run ended is one of ``ok | exit | timeout | cpu | memory | output_limit | signal |
error`` (:class:`Result`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import platform
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Optional

log = logging.getLogger("sandbox")

LAUNCHER = str(Path(__file__).with_name("_launch.py"))
_logged: set[str] = set()
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")
SLOTS = 4096  # concurrent runs on one machine, as root: uids uid_base .. uid_base + SLOTS - 1
# Address space a process may have beyond memory_mb where the run's cgroup bounds its real memory: each thread
# reserves its stack (8 MiB by default), so RLIMIT_AS = memory_mb alone allowed ~14 threads in 512 MiB
THREAD_ROOM_MB = 1024
# Without a cgroup (a plain user: most clusters), the run's memory is bounded by its processes instead, where a
# process cap per run holds (RLIMIT_NPROC of its own uid or user namespace): at most NO_CGROUP_TASKS tasks, each
# process with an address space of memory_mb * NO_CGROUP_FACTOR / NO_CGROUP_TASKS, so all of them together hold
# at most NO_CGROUP_FACTOR x memory_mb (plus the private /tmp and /dev/shm, tmp_mb each)
NO_CGROUP_TASKS = 4
NO_CGROUP_FACTOR = 2


class SandboxError(RuntimeError):
    """The sandbox could not run the program (an infrastructure error, not the program's)."""


@dataclass
class Limits:
    """The limits of one execution (the ``sandbox:`` config section, grpo/foundation/config.py)."""

    timeout: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    processes: int = 256
    max_output_bytes: int = 65536
    tmp_mb: int = 64
    network: str = "auto"
    isolation: str = "auto"
    user: str = "auto"
    uid_base: int = 2_100_000_000
    python: str = ""
    memory: str = "auto"

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
    cpu (RLIMIT_CPU) | memory (MemoryError, a failed allocation, the run's cgroup out of memory) | output_limit |
    signal (killed by another signal: a segfault, a kill) | error (the sandbox could not run it: ``error`` says
    why)."""

    reason: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False
    notes: list[str] = field(default_factory=list)
    error: str = ""

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


@dataclass(frozen=True)
class Plan:
    """How runs are isolated on this machine, for one (python, user, network, isolation): probed once."""

    python: str
    namespaces: bool  # own PID, mount, IPC and UTS namespaces, a private root
    userns: bool  # ... inside a user namespace (not root)
    network: str  # what the launcher is asked: auto/required (own namespace) or allowed
    ids: Optional[tuple[int, int]]  # one user for every run (sandbox.user names one)
    slots: bool  # a uid of its own per concurrent run (root, user auto)
    nproc: bool  # RLIMIT_NPROC is per run (own uid, or counted per user namespace)
    read_only: tuple[str, ...]
    cgroup: Optional[dict]
    why_not: str = ""  # why the namespaces could not be had


def _kernel_counts_nproc_per_userns() -> bool:
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


@lru_cache(maxsize=None)
def _prefixes(python: str) -> tuple[str, ...]:
    """The folders an interpreter needs (its prefixes, a venv's and its base), real paths."""
    try:
        out = subprocess.run([python, "-I", "-c", "import sys, json; print(json.dumps([sys.prefix, "
                              "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"],
                             capture_output=True, text=True, timeout=30, env={})
        dirs = json.loads(out.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        dirs = []
    dirs += [os.path.dirname(os.path.abspath(python)), os.path.dirname(os.path.realpath(python))]
    found: list[str] = []
    for d in sorted({os.path.realpath(x) for x in dirs} | {os.path.abspath(x) for x in dirs}):
        if d != "/" and not any(d == s or d.startswith(s + "/") for s in (*SYSTEM_DIRS, *found)):
            found.append(d)
    return tuple(found)


PROC_CGROUP, CGROUP_FS = "/proc/self/cgroup", "/sys/fs/cgroup"
LEAF = "grpo-trainer"  # the child of a delegated cgroup v2 the trainer's processes move into (see _delegated_v2)
RUN_CONTROLLERS = {"memory", "pids"}


def _own_cgroup(controller: str) -> Optional[str]:
    """This process's cgroup folder for ``controller`` ("" = the v2 hierarchy), where it can be written."""
    try:
        lines = Path(PROC_CGROUP).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(",") if controller else names == "":
            mounts = [f"{CGROUP_FS}/{controller}"] if controller else [f"{CGROUP_FS}/unified", CGROUP_FS]
            for m in mounts:
                d = m + path.rstrip("/")
                if os.path.isfile(os.path.join(d, "cgroup.procs")) and os.access(d, os.W_OK):
                    return d
    return None


def _listed(d: str, name: str) -> set[str]:
    try:
        return set(Path(d, name).read_text().split())
    except OSError:
        return set()


def _move_processes(src: str, dst: str) -> None:
    """Every process of cgroup ``src`` into ``dst`` (one pid a write; a process gone meanwhile is skipped)."""
    for pid in Path(src, "cgroup.procs").read_text().split():
        try:
            with open(os.path.join(dst, "cgroup.procs"), "a") as f:
                f.write(pid + "\n")
        except ProcessLookupError:
            pass


def _enable_for_children(d: str) -> None:
    Path(d, "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(RUN_CONTROLLERS)))


@contextmanager
def _cgroup_lock() -> Iterator[None]:
    """One process of this user at a time (the ranks and worker processes of a run share their cgroup). The lock
    file in the shared temp folder is neither followed if a link nor truncated: another user cannot point it at a
    file of this one's."""
    path = os.path.join(tempfile.gettempdir(), f"grpo-sandbox-cgroup-{os.getuid()}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _v2_parent() -> tuple[Optional[str], bool]:
    """(the cgroup v2 folder the runs' cgroups would go in, whether its children get both controllers already):
    this process's own writable cgroup, or the parent of :data:`LEAF` when this process is in it; None where
    memory and pids are not delegated to it."""
    own = _own_cgroup("")
    if own is None:
        return None, False
    parent = os.path.dirname(own) if os.path.basename(own) == LEAF else own
    if RUN_CONTROLLERS <= _listed(parent, "cgroup.subtree_control"):
        return parent, True
    if RUN_CONTROLLERS <= _listed(parent, "cgroup.controllers") and os.access(
            os.path.join(parent, "cgroup.subtree_control"), os.W_OK):
        return parent, False
    return None, False


def _delegated_v2() -> Optional[str]:
    """The cgroup v2 folder whose children (the runs' cgroups) get the memory and pids controllers, or None.

    It is this process's own writable cgroup, or the parent of the leaf below when this process is in it, where
    both controllers are delegated to it (its cgroup.controllers: ``systemd-run --user -p Delegate=yes``, a
    container's own cgroup). cgroup v2 gives a cgroup's children a controller only while the cgroup itself holds no
    process, and a delegated cgroup holds the trainer: so, once, the processes in it move into a child of it,
    ``grpo-trainer`` (:data:`LEAF`: the same subtree, so the same accounting and limits), and the two controllers
    are enabled for its children. Done under a lock: the ranks and reward workers of a run share the cgroup.
    Where that fails, every process moves back, and the run goes on without a cgroup (said at start)."""
    parent, ready = _v2_parent()
    if parent is None or ready:
        return parent
    try:
        with _cgroup_lock():
            parent, ready = _v2_parent()  # again: another process of the run may have done it meanwhile
            if parent is not None and not ready:
                _hold_runs(parent)
            return parent
    except OSError as e:
        _log_once("cgroup-v2", f"sandbox: the delegated cgroup {parent} cannot hold the runs' cgroups ({e}): "
                               "runs go without a cgroup")
        return None


def _hold_runs(parent: str) -> None:
    """Enable memory and pids for ``parent``'s children, its processes moved into :data:`LEAF` first (OSError
    otherwise, every process moved back). A hierarchy's root is never emptied (the machine's root may enable them
    as it is; a container's namespace root stays as it is)."""
    if parent in (CGROUP_FS, f"{CGROUP_FS}/unified"):
        _enable_for_children(parent)
        return
    leaf = os.path.join(parent, LEAF)
    os.makedirs(leaf, exist_ok=True)
    try:
        for attempt in range(5):  # a process started meanwhile keeps the controllers off (EBUSY): move again
            _move_processes(parent, leaf)
            try:
                _enable_for_children(parent)
                return
            except OSError as e:
                if e.errno != errno.EBUSY or attempt == 4:
                    raise
    except OSError:
        with contextlib.suppress(OSError):
            _move_processes(leaf, parent)
            os.rmdir(leaf)
        raise


@lru_cache(maxsize=None)
def _cgroup_layout() -> Optional[dict]:
    """Where a run's cgroup can be made: {"memory": folder, "pids": folder}, v1 or v2, or None."""
    v1 = {c: _own_cgroup(c) for c in ("memory", "pids")}
    if all(v1.values()):
        return v1
    v2 = _delegated_v2()
    return {"memory": v2, "pids": v2} if v2 else None


class _Cgroup:
    """One run's cgroup(s): ``memory_mb`` and ``processes`` on the run as a whole."""

    _count = 0
    _lock = threading.Lock()

    def __init__(self, layout: dict, lim: Limits):
        with self._lock:
            _Cgroup._count += 1
            name = f"grpo-sandbox-{os.getpid()}-{_Cgroup._count}"
        self.dirs = sorted({os.path.join(parent, name) for parent in layout.values()})
        self.v2 = len(self.dirs) == 1
        for d in self.dirs:
            os.mkdir(d)
        mem, pids = os.path.join(layout["memory"], name), os.path.join(layout["pids"], name)
        if lim.memory_mb:
            size = str(lim.memory_mb * 1024 * 1024)
            self._write(mem, "memory.max" if self.v2 else "memory.limit_in_bytes", size)
            if self.v2 and os.path.exists(os.path.join(mem, "memory.swap.max")):
                self._write(mem, "memory.swap.max", "0")
        if lim.processes:
            self._write(pids, "pids.max", str(lim.processes + 2))  # + the launcher and the namespace's init
        self.mem = mem

    @staticmethod
    def _write(d: str, name: str, value: str) -> None:
        Path(d, name).write_text(value)

    @property
    def procs(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def out_of_memory(self) -> bool:
        try:
            text = Path(self.mem, "memory.events" if self.v2 else "memory.oom_control").read_text()
        except OSError:
            return False
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0

    def close(self) -> None:
        """Kill what is left in it (nothing, normally) and remove it; a cgroup the kernel still holds for a
        moment (its last task exiting) is removed by a background thread, off the run's time."""
        busy = [d for d in self.dirs if not self._remove(d)]
        if busy:
            threading.Thread(target=self._remove_later, args=(busy,), daemon=True).start()

    @staticmethod
    def _remove(d: str) -> bool:
        try:
            pids = [int(p) for p in Path(d, "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    @classmethod
    def _remove_later(cls, dirs: list[str]) -> None:
        end = time.monotonic() + 10
        while dirs and time.monotonic() < end:
            time.sleep(0.01)
            dirs = [d for d in dirs if not cls._remove(d)]
        if dirs:
            _log_once("cgroup-rmdir", f"sandbox: could not remove the cgroups {dirs}")


def _slot_dir() -> str:
    d = os.path.join(tempfile.gettempdir(), "grpo-sandbox-slots")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


@contextmanager
def _slot(plan: Plan, lim: Limits) -> Iterator[Optional[tuple[int, int]]]:
    """The (uid, gid) of this run: a slot of its own (held by a lock until the run ends), the named user, or
    None (keep the trainer's uid)."""
    if not plan.slots:
        yield plan.ids
        return
    d = _slot_dir()
    for n in range(SLOTS):
        fd = os.open(os.path.join(d, f"{n}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            yield lim.uid_base + n, lim.uid_base + n
        finally:
            os.close(fd)
        return
    raise SandboxError(f"sandbox: all {SLOTS} uid slots are taken (concurrent runs on this machine)")


def _launch(spec: dict, argv: list[str], work: str, timeout: float = 30) -> tuple[int, str]:
    """Run the launcher with ``spec`` and wait: (exit code, the launcher's error line)."""
    proc, read_end = _spawn(spec, argv, work, stdin=False)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, _read_status(read_end) or err.decode(errors="replace").strip()
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
        return -9, "the probe did not finish"
    finally:
        os.close(read_end)


def _read_status(fd: int) -> str:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096).decode(errors="replace").strip()
    except BlockingIOError:
        return ""


@lru_cache(maxsize=None)
def _plan(python: str, user: str, network: str, isolation: str, uid_base: int) -> Plan:
    root = os.geteuid() == 0
    ids: Optional[tuple[int, int]] = None
    slots = False
    if root and user == "auto":
        slots = True
    elif root and user:
        try:
            pw = pwd.getpwnam(user)
            ids = (pw.pw_uid, pw.pw_gid)
        except KeyError:
            raise SandboxError(f"sandbox.user={user!r} does not exist on this machine: create it, or give 'auto' "
                               f"(a uid of its own per run, from sandbox.uid_base) or '' (stay root: not advised)")
    python = python or sys.executable
    read_only = tuple(d for d in SYSTEM_DIRS if os.path.lexists(d)) + _prefixes(python)
    userns = not root
    probe_uid = (uid_base, uid_base) if slots else ids
    spec = {"namespaces": True, "userns": userns, "network": "auto" if network != "allowed" else "allowed",
            "read_only": list(read_only), "uid": probe_uid[0] if probe_uid else None,
            "gid": probe_uid[1] if probe_uid else None}
    work = tempfile.mkdtemp(prefix="sandbox-probe-")
    try:
        os.mkdir(os.path.join(work, "work"))
        os.mkdir(os.path.join(work, "root"))
        if probe_uid:
            os.chown(os.path.join(work, "work"), *probe_uid)
        os.chmod(work, 0o755)
        if isolation == "none":
            namespaces, why = False, "sandbox.isolation is none"
        else:
            rc, why = _launch(dict(spec, work=os.path.join(work, "work"), root=os.path.join(work, "root")),
                              [python, "-I", "-S", "-c", "pass"], work)
            # an interpreter that cannot be run is every run's error (SandboxError), not a reason to run weaker
            namespaces = rc == 0 or why.startswith("sandbox launcher: exec ")
        net = network
        if not namespaces:
            # without namespaces: a network namespace alone, as before
            net_rc, _ = _launch({"network": "required"}, [sys.executable, "-I", "-S", "-c", "pass"], work)
            if net_rc != 0 and network == "auto":
                net = "allowed"
            if (probe_uid or ids) and not _world_executable(python):  # no private root: the uid must reach it
                python = next((c for c in ("/usr/bin/python3", "/usr/local/bin/python3") if _world_executable(c)),
                              python)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nproc = bool(slots or ids) or (namespaces and userns and _kernel_counts_nproc_per_userns())
    return Plan(python=python, namespaces=namespaces, userns=userns and namespaces,
                network=net if not namespaces else ("allowed" if network == "allowed" else "auto"),
                ids=ids, slots=slots, nproc=nproc, read_only=read_only, cgroup=_cgroup_layout(),
                why_not="" if namespaces else why)


def plan_of(lim: Limits) -> Plan:
    return _plan(lim.python, lim.user, lim.network, lim.isolation, lim.uid_base)


def capabilities(limits: Any = None) -> dict[str, Any]:
    """What the sandbox enforces here, probed once: ``namespaces`` (own PID and mount namespaces: every process
    ends with the run, only its folder is writable, private /tmp), ``network`` (own namespace), ``own_uid``
    (a uid per run), ``drops_user`` (runs as a user other than root), ``unprivileged`` (cannot write the
    trainer's files or read its private ones), ``processes`` (how fork bombs are capped, or None),
    ``cgroup`` (memory and processes bounded on the whole run), ``python``."""
    lim = Limits.of(limits)
    plan = plan_of(lim)
    return {"namespaces": plan.namespaces, "network": plan.network == "auto" and lim.network != "allowed",
            "own_uid": plan.slots, "drops_user": bool(plan.slots or plan.ids), "userns": plan.userns,
            "unprivileged": bool(plan.slots or plan.ids) or plan.namespaces,
            "processes": ("cgroup" if plan.cgroup and lim.processes else "rlimit" if plan.nproc else None),
            "cgroup": plan.cgroup is not None, "memory": memory_bound(plan, lim), "python": plan.python,
            "why_not": plan.why_not}


def describe(limits: Any = None) -> str:
    """One line: which protections hold on this machine and which do not (the trainer logs it at start)."""
    caps = capabilities(limits)
    holds, lacks = [], []
    (holds if caps["namespaces"] else lacks).append("own PID namespace and private root (nothing outlives a run; "
                                                    "only its folder writable; private /tmp and /dev/shm)")
    (holds if caps["network"] else lacks).append("no network")
    if caps["own_uid"]:
        holds.append("a uid of its own per run")
    elif caps["userns"]:
        holds.append("a user namespace (the trainer's uid, no capability)")
    elif caps["drops_user"]:
        holds.append("one unprivileged user for every run")
    else:
        lacks.append("another user than the trainer's")
    (holds if caps["cgroup"] else lacks).append("a cgroup on the whole run (memory, processes)")
    (holds if caps["processes"] else lacks).append("a process cap (fork bombs)")
    lim = Limits.of(limits)
    if caps["memory"] == "processes":
        address_mb, tasks = process_limits(plan_of(lim), lim)[0], no_cgroup_tasks(lim)
        holds.append(f"the run's memory bounded without a cgroup: at most {tasks} processes and threads of "
                     f"{address_mb} MiB address space each ({tasks * address_mb} MiB = {NO_CGROUP_FACTOR} x "
                     f"sandbox.memory_mb)")
    elif lim.memory_mb and not caps["memory"]:
        lacks.append(f"the run's memory as a whole (each process alone is held to {lim.memory_mb} MiB; "
                     f"sandbox.memory: required refuses to start so)")
    text = f"sandbox ({caps['python']}): holds {'; '.join(holds) or 'rlimits only'}"
    if lacks:
        text += f"; does NOT hold {'; '.join(lacks)}"
        if caps["why_not"]:
            text += f" (namespaces refused: {caps['why_not']})"
    return text


def announce(limits: Any = None) -> None:
    """Print :func:`describe` once per process on stderr, on rank 0 (as the trainer's other start-up lines): a
    reward or a tool that runs model code calls it when the run builds it."""
    text = describe(limits)
    if text not in _logged:
        _logged.add(text)
        if os.environ.get("RANK", "0") == "0":
            print(text, file=sys.stderr, flush=True)


def check(limits: Any = None) -> None:
    """Raise SandboxError when the config asks for what this machine cannot give (``network: required``,
    ``isolation: required``); the trainer and ``--print-config`` call it."""
    lim = Limits.of(limits)
    caps = capabilities(lim)
    if lim.network == "required" and not caps["network"]:
        raise SandboxError("sandbox.network=required, but this machine refuses a network namespace (unshare "
                           "CLONE_NEWNET needs CAP_SYS_ADMIN or a user namespace): run the trainer as root, or with "
                           f"--cap-add SYS_ADMIN in a container, or set sandbox.network: auto ({caps['why_not']})")
    if lim.isolation == "required" and not caps["namespaces"]:
        raise SandboxError("sandbox.isolation=required, but this machine refuses the sandbox's PID and mount "
                           f"namespaces ({caps['why_not']}): allow user namespaces or CAP_SYS_ADMIN, or set "
                           "sandbox.isolation: auto to run with rlimits only")
    if lim.memory == "required" and lim.memory_mb and not caps["memory"]:
        raise SandboxError(f"sandbox.memory=required, but nothing here bounds a run's memory as a whole: no cgroup "
                           f"can be made (run the trainer as root, or in a cgroup v2 subtree delegated to its user "
                           f"with the memory and pids controllers) and no process cap holds per run (a user "
                           f"namespace on Linux >= 5.14); each process alone is held to sandbox.memory_mb="
                           f"{lim.memory_mb}. Set sandbox.memory: auto to run so")


def memory_bound(plan: Plan, lim: Limits) -> Optional[str]:
    """How the run's memory is bounded as a whole: "cgroup", "processes" (without a cgroup: a process cap per run
    and a smaller address space each, :data:`NO_CGROUP_TASKS`), or None (per process only; or no memory limit)."""
    if not lim.memory_mb:
        return None
    if plan.cgroup:
        return "cgroup"
    return "processes" if plan.nproc else None


def no_cgroup_tasks(lim: Limits) -> int:
    """The processes and threads a run may have at once without a cgroup (its memory bound, NO_CGROUP_TASKS)."""
    return min(lim.processes, NO_CGROUP_TASKS) if lim.processes else NO_CGROUP_TASKS


def process_limits(plan: Plan, lim: Limits) -> tuple[int, int]:
    """(RLIMIT_AS in MiB, RLIMIT_NPROC; 0 = none) of the run's processes."""
    bound = memory_bound(plan, lim)
    nproc = lim.processes if plan.nproc else 0
    if bound == "cgroup":
        return lim.memory_mb + THREAD_ROOM_MB, nproc
    if bound == "processes":
        tasks = no_cgroup_tasks(lim)
        # in a user namespace its count holds the launcher and the namespace's init too (ours, outside the bound)
        return lim.memory_mb * NO_CGROUP_FACTOR // tasks, tasks + (2 if plan.userns else 0)
    return lim.memory_mb, nproc


def python_command(lim: Limits) -> list[str]:
    """The interpreter and its flags: isolated mode (no PYTHON* variables, no user site, no cwd on sys.path)."""
    return [plan_of(lim).python, "-I", "-B"]


@dataclass
class _Prepared:
    """A run ready to start: its launcher spec, folder, argv, limits, and what must be undone after it."""

    spec: dict
    base: str
    argv: list[str]
    lim: Limits
    plan: Plan
    ids: Optional[tuple[int, int]]
    cgroup: Optional[_Cgroup]

    def finish(self, result: Result) -> Result:
        if self.cgroup and result.reason in ("signal", "exit") and self.cgroup.out_of_memory():
            result.reason = "memory"
        if self.ids and not self.plan.namespaces and result.reason in ("timeout", "output_limit"):
            _kill_uid(self.ids[0])  # the launcher was killed before it could end the uid's processes
        return result


@contextmanager
def _prepared(argv: list[str], limits: Any, files: Optional[dict[str, str]]) -> Iterator[_Prepared]:
    """The run's uid slot, folder (holding ``files``), cgroup and launcher spec; all undone at the end."""
    lim = Limits.of(limits)
    plan = plan_of(lim)
    if (lim.isolation == "required" and not plan.namespaces) or (lim.memory == "required" and lim.memory_mb
                                                                   and not memory_bound(plan, lim)):
        check(lim)
    if lim.network == "auto" and plan.network == "allowed":
        _log_once("network", "sandbox: this kernel/container refuses a new network namespace (unshare "
                             "CLONE_NEWNET): untrusted code has the trainer's network (docs/sandbox.md)")
    if argv and argv[0] == "python":
        argv = python_command(lim) + list(argv[1:])
    with _slot(plan, lim) as ids:
        base = tempfile.mkdtemp(prefix="sandbox-")
        work = os.path.join(base, "work")
        cgroup = None
        try:
            os.chmod(base, 0o755)
            os.mkdir(work)
            if plan.namespaces:
                os.mkdir(os.path.join(base, "root"))
            for name, text in (files or {}).items():
                Path(work, name).write_text(text)
            if ids:
                for p in [work, *(str(Path(work, n)) for n in files or {})]:
                    os.chown(p, *ids)
            if plan.cgroup:
                cgroup = _Cgroup(plan.cgroup, lim)
            address_mb, tasks = process_limits(plan, lim)
            spec = {"memory_mb": address_mb, "cpu_seconds": lim.cpu_seconds, "file_size_mb": lim.file_size_mb,
                    "open_files": lim.open_files, "nproc": tasks,
                    "network": plan.network if lim.network != "required" else "required",
                    "uid": ids[0] if ids else None, "gid": ids[1] if ids else None, "work": work,
                    "namespaces": plan.namespaces, "userns": plan.userns, "read_only": list(plan.read_only),
                    "root": os.path.join(base, "root") if plan.namespaces else None, "tmp_mb": lim.tmp_mb,
                    "cgroups": cgroup.procs if cgroup else []}
            yield _Prepared(spec, base, list(argv), lim, plan, ids, cgroup)
        finally:
            if cgroup:
                cgroup.close()
            shutil.rmtree(base, ignore_errors=True)


def run(argv: list[str], limits: Any = None, stdin: Optional[str] = None,
        files: Optional[dict[str, str]] = None) -> Result:
    """Run ``argv`` (``argv[0]`` = ``"python"`` means the sandbox's interpreter) in a fresh folder holding
    ``files`` (name -> text), under ``limits``; ``stdin`` is its input (None: closed)."""
    with _prepared(argv, limits, files) as p:
        return p.finish(_execute(p, stdin))


def _kill_uid(uid: int) -> None:
    subprocess.run([sys.executable, "-I", "-S", "-c", f"import os; os.setuid({uid}); os.kill(-1, 9)"],
                   env={}, capture_output=True, timeout=30)


def _spawn(spec: dict, argv: list[str], cwd: str, stdin: bool) -> tuple[subprocess.Popen, int]:
    """The launcher started with ``spec`` in a session of its own (stdout and stderr piped; stdin piped or
    closed): (process, status pipe's read end). OSError when it cannot start."""
    read_end, write_end = os.pipe()
    cmd = [sys.executable, "-I", "-S", LAUNCHER, repr(dict(spec, status_fd=write_end)), "--", *argv]
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env={}, start_new_session=True, close_fds=True,
                                pass_fds=(write_end,), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return proc, read_end


def _ended(proc: subprocess.Popen, read_end: int, reason: Optional[str], t0: float, out: dict, lim: Limits) -> Result:
    """After the run's streams closed or it was stopped: wait, close, read the launcher's status, the Result."""
    _kill_group(proc.pid, wait=2.0)  # anything it left behind in its group, gone before the next run
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except OSError:
                pass
    error = _read_status(read_end)
    os.close(read_end)
    rc = proc.returncode
    stdout = bytes(out["stdout"][:lim.max_output_bytes]).decode(errors="replace")
    stderr = bytes(out["stderr"][:lim.max_output_bytes]).decode(errors="replace")
    truncated = any(len(b) > lim.max_output_bytes for b in out.values())
    if error:
        reason = "error"
    elif reason is None:
        reason = _reason(rc, stderr)
    return Result(reason, rc, stdout, stderr, time.monotonic() - t0, truncated, error=error)


def _execute(p: _Prepared, stdin: Optional[str]) -> Result:
    t0, lim = time.monotonic(), p.lim
    try:
        proc, read_end = _spawn(p.spec, p.argv, p.base, stdin is not None)
    except OSError as e:
        return Result("error", None, "", "", 0.0, error=f"sandbox could not start its launcher: {e}")
    out = {"stdout": bytearray(), "stderr": bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    pending = memoryview(stdin.encode()) if stdin is not None else None
    if pending is not None:  # fed as the program reads it: any size, and a program that never reads blocks nothing
        os.set_blocking(proc.stdin.fileno(), False)
        if len(pending):
            sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
        else:
            proc.stdin.close()
    deadline = t0 + lim.timeout
    reason = None
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            if key.data == "stdin":
                try:
                    pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
                except BlockingIOError:
                    continue
                except OSError:  # it closed its stdin: the rest is not read
                    pending = pending[:0]
                if not len(pending):
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
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
    sel.close()
    if reason is not None:
        _stop(proc)
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()) if reason is None else 5)
    except subprocess.TimeoutExpired:  # stdout closed but still running (it closed its own streams)
        reason = "timeout"
        _stop(proc)
        proc.wait(timeout=5)
    return _ended(proc, read_end, reason, t0, out, lim)


class Session:
    """A run talked to while it runs (the ``code_tests`` judge): ``send`` writes a line to its stdin,
    ``receive`` reads a line of its stdout; one wall clock (``limits.timeout``) for the whole session, its
    stderr kept up to ``max_output_bytes`` (past it the run is stopped: ``output_limit``), a stdout line up to
    ``max_line_bytes``. ``close`` stops it and returns its :class:`Result`."""

    def __init__(self, argv: list[str], limits: Any = None, files: Optional[dict[str, str]] = None,
                 max_line_bytes: int = 8 << 20):
        self._ctx = _prepared(argv, limits, files)
        self._p = self._ctx.__enter__()
        self.lim, self.max_line_bytes = self._p.lim, max_line_bytes
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.lim.timeout
        self.reason: Optional[str] = None
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self._lines = bytearray()
        self.result: Optional[Result] = None
        try:
            self.proc, self._status = _spawn(self._p.spec, self._p.argv, self._p.base, True)
        except OSError as e:
            self.proc = None
            self.result = Result("error", None, "", "", 0.0, error=f"sandbox could not start its launcher: {e}")
            return
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            os.set_blocking(stream.fileno(), False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ, "stdout")
        self._sel.register(self.proc.stderr, selectors.EVENT_READ, "stderr")
        self._open = 2

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _pump(self, want_write: bool) -> bool:
        """One wait for its output (and, with ``want_write``, for room in its stdin); False once it is over."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.reason = self.reason or "timeout"
            return False
        if want_write:
            self._sel.register(self.proc.stdin, selectors.EVENT_WRITE, "stdin")
        try:
            events = self._sel.select(timeout=min(left, 0.5))
        finally:
            if want_write:
                self._sel.unregister(self.proc.stdin)
        self._writable = False
        for key, _ in events:
            if key.data == "stdin":
                self._writable = True
                continue
            try:
                chunk = os.read(key.fileobj.fileno(), 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self._sel.unregister(key.fileobj)
                self._open -= 1
                continue
            if key.data == "stdout":
                self._lines += chunk
                if len(self._lines) > self.max_line_bytes and b"\n" not in self._lines:
                    self.reason = "output_limit"
            else:
                self.out["stderr"] += chunk
                if len(self.out["stderr"]) > self.lim.max_output_bytes:
                    self.reason = "output_limit"
        return self.reason is None and (self._open > 0 or want_write)

    def send(self, line: str) -> bool:
        """Write ``line`` and a newline; False when the run is over (ended, stopped, or its time is up)."""
        if self.proc is None or self.reason:
            return False
        data = memoryview((line + "\n").encode())
        while len(data):
            try:
                data = data[os.write(self.proc.stdin.fileno(), data):]
                continue
            except BlockingIOError:
                pass
            except OSError:  # it closed its stdin or ended
                return False
            if not self._pump(want_write=True):
                return False
        return True

    def receive(self) -> Optional[str]:
        """Its next stdout line (without the newline); None when the run is over first."""
        if self.proc is None:
            return None
        while b"\n" not in self._lines:
            if self.reason or self._open == 0 or not self._pump(want_write=False):
                return None
        line, _, rest = bytes(self._lines).partition(b"\n")
        self._lines = bytearray(rest)
        return line.decode(errors="replace")

    def close(self) -> Result:
        """Stop the run (if it still runs) and undo its folder, cgroup and slot: its Result."""
        if self.result is None:
            self._sel.close()
            if self._open == 0 and self.reason is None:  # it closed its output: it is ending on its own
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                _stop(self.proc)
                self.reason = self.reason or "stopped"
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait(timeout=5)
            self.out["stdout"] = self._lines
            reason = self.reason if self.reason != "stopped" else None
            self.result = self._p.finish(_ended(self.proc, self._status, reason, self.t0, self.out, self.lim))
            if self.reason == "stopped" and self.result.reason != "error":
                self.result.reason = "ok"  # stopped by its caller once done: not the program's failure
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        return self.result


def _stop(proc: subprocess.Popen) -> None:
    """Stop a run: the launcher kills and reaps its child (so no zombie is left to the machine's init), then
    exits; a launcher that does not within 2 s is killed with its group."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        pass
    _kill_group(proc.pid)


def _reason(rc: int, stderr: str) -> str:
    if rc == 0:
        return "ok"
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and "cpu" in stderr[-200:].lower()):
        return "cpu"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
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
