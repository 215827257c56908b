"""The sandbox's launcher (grpo/workers/sandbox.py): ``python -I -S _launch.py SPEC -- ARGV...``.

Runs in the new session the parent made and applies SPEC (the parent's ``repr`` of a mapping of plain values)
before ARGV runs. Standard library
only, no imports from the project (it runs with ``-I -S``). A step that was asked for and fails (a namespace,
a mount, a limit, the user, the fork or the exec) writes one line to the status pipe (``status_fd``) and exits
121: nothing runs with fewer protections than it was given, and the parent tells "could not run" (an
infrastructure error) from anything the program does, whatever its exit code. The pipe is closed on exec: the
program cannot write to it.

With ``namespaces`` (docs/sandbox.md, "How it holds"):

  launcher (the parent's session)  joins the run's cgroups, ``unshare``s new PID, mount, IPC, UTS and network
  |                                namespaces (and a user namespace when not root: the trainer's uid is the
  |                                program's only uid, seen inside as 65534), forks, waits, ends as init ended
  +- init (PID 1 of the namespace) builds a private root: tmpfs, the system folders and the interpreter's
     |                             read-only, its own /proc, /dev, /tmp and /dev/shm, the run's folder the only
     |                             one writable; reaps every orphan; when the program ends, it ends, and the
     |                             kernel kills whatever is left in the namespace (``setsid`` or not)
     +- program                    sets the resource limits, drops to the run's uid (as root), execs ARGV

Without: the launcher is a child subreaper (orphans are reaped, not left as zombies), the program gets the
same limits and uid, and after it, as root, every process of the run's own uid is killed.
"""

import ctypes
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG = 36, 1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
INNER_ID = 65534  # the program's uid and gid inside a user namespace (nobody)
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
STATUS_FD = -1


def fail(msg):
    os.write(STATUS_FD if STATUS_FD >= 0 else 2, f"sandbox launcher: {msg}\n".encode())
    os._exit(121)


def call(what, rc):
    if rc != 0:
        fail(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def mount(src, dst, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    call(f"mount {dst} ({fstype or src})", libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)))


def write(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        fail(f"writing {text.strip()!r} to {path} failed: {e}")


def makedirs(path):
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError as e:
        fail(f"mkdir {path} failed: {e}")


def bind(src, dst, read_only):
    """Bind ``src`` at ``dst`` (a file or a folder; a symlink is recreated as one)."""
    if os.path.islink(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.lexists(dst):
            os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        makedirs(dst)
    else:
        makedirs(os.path.dirname(dst))
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    if read_only:  # a remount must keep the flags the source mount has locked (in a user namespace)
        st = os.statvfs(src).f_flag
        keep = [(os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                (os.ST_RELATIME, MS_RELATIME), (os.ST_NODEV, MS_NODEV)]
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | sum(m for s, m in keep if st & s)
        mount(None, dst, None, flags)


def build_root(spec):
    """A fresh root for the program: only what it needs, its run folder the only writable path of the host."""
    new, tmp_mb = spec["root"], max(1, int(spec.get("tmp_mb") or 64))
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    makedirs(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            bind("/dev/" + name, f"{new}/dev/{name}", False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    for d in ("/tmp", "/dev/shm"):  # private, bounded, gone with the run
        makedirs(new + d)
        mount("tmpfs", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    for src in spec["read_only"]:  # after /tmp: an interpreter under /tmp (a checkout there) stays visible
        if os.path.lexists(src):
            bind(src, new + src, True)
    bind(spec["work"], new + spec["work"], False)
    makedirs(new + "/proc")
    # a container that masks parts of its /proc refuses a new one to a user namespace: then there is none
    libc.mount(b"proc", (new + "/proc").encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.chdir(new)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        fail(f"pivot_root: unknown system call number on {os.uname().machine}")
    call("pivot_root", libc.syscall(number, b".", b"."))
    call("umount of the old root", libc.umount2(b".", MNT_DETACH))
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def limits(spec):
    mb = 1024 * 1024
    todo = [(resource.RLIMIT_CORE, 0)]
    for key, which, scale in (("memory_mb", resource.RLIMIT_AS, mb), ("cpu_seconds", resource.RLIMIT_CPU, 1),
                              ("file_size_mb", resource.RLIMIT_FSIZE, mb), ("open_files", resource.RLIMIT_NOFILE, 1),
                              ("nproc", resource.RLIMIT_NPROC, 1)):
        if spec.get(key):
            todo.append((which, spec[key] * scale))
    for which, value in todo:
        try:
            # soft = hard: the program cannot raise it back; CPU: SIGXCPU at the soft limit, SIGKILL 1 s later
            resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
        except (ValueError, OSError) as e:
            fail(f"setrlimit({which}, {value}) failed: {e}")


def program(spec, argv):
    """In the child: limits, the run's user, exec (never returns)."""
    limits(spec)
    if spec.get("uid") is not None:
        try:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        except OSError as e:
            fail(f"dropping to uid {spec['uid']} failed: {e}")
    os.chdir(spec["work"])
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        fail(f"exec {argv[0]!r} failed: {e}")


def start(spec, argv):
    try:
        pid = os.fork()
    except OSError as e:
        fail(f"fork failed: {e}")
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not spec.get("namespaces"):
            os.setpgid(0, 0)  # a group of its own, which the launcher kills when the program ends
        program(spec, argv)
    return pid


STOP = {"pid": None, "group": False, "asked": False}


def on_sigterm(*_):
    """The parent's timeout is a SIGTERM to this process: the child it started (its group) is killed and reaped
    here, so that nothing of the run is left for the machine's init to reap (a container's PID 1 may never)."""
    STOP["asked"] = True
    if STOP["pid"]:
        try:
            (os.killpg if STOP["group"] else os.kill)(STOP["pid"], signal.SIGKILL)
        except OSError:
            pass


def stop_on_sigterm(pid, group=False):
    STOP.update(pid=pid, group=group)
    if STOP["asked"]:  # it came before the child existed
        on_sigterm()


def reap_until(pid):
    """Reap every child (orphans included) until ``pid`` ends; its wait status."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            fail("the program's process vanished")
        except InterruptedError:
            continue
        if done == pid:
            return status


def end_as(status):
    """Exit the way a process with wait status ``status`` ended, so that the parent reads the same."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 121)


def init(spec, argv, report):
    """PID 1 of the new namespace: the root, the program, the reaping; its end ends the namespace."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed (a timeout): the namespace goes with it
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if spec.get("root"):
        build_root(spec)
    STOP.update(pid=None, asked=False)
    pid = start(spec, argv)
    stop_on_sigterm(pid)
    status = reap_until(pid)
    os.write(report, status.to_bytes(4, "little", signed=True))  # PID 1 cannot end by a signal of its own
    os._exit(0)


def with_namespaces(spec, argv):
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    if spec.get("network") in ("auto", "required"):
        flags |= CLONE_NEWNET
    user = spec.get("userns")
    outer_uid, outer_gid = os.getuid(), os.getgid()
    if user:
        flags |= CLONE_NEWUSER
    call("unshare", libc.unshare(flags))
    if user:  # the trainer's uid is the only one: 65534 inside; the program loses every capability at exec
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"{INNER_ID} {outer_uid} 1\n")
        write("/proc/self/gid_map", f"{INNER_ID} {outer_gid} 1\n")
    read_end, report = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        fail(f"fork of the namespace's init failed: {e}")
    if pid == 0:
        os.close(read_end)
        init(spec, argv, report)
    os.close(report)
    stop_on_sigterm(pid)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    got = os.read(read_end, 4)
    if len(got) == 4:
        end_as(int.from_bytes(got, "little", signed=True))
    end_as(status)  # init failed (its line is on the status pipe) or was killed


def without_namespaces(spec, argv):
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the run are this process's children: reaped below
    pid = start(spec, argv)
    stop_on_sigterm(pid, group=True)
    status = reap_until(pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(pid, signal.SIGKILL)  # what stayed in the program's group
    except OSError:
        pass
    if spec.get("uid") is not None and os.geteuid() == 0:
        # the uid is this run's alone: whatever still runs as it (a setsid daemon) is this run's
        killer = os.fork()
        if killer == 0:
            os.setuid(spec["uid"])
            os.kill(-1, signal.SIGKILL)
            os._exit(0)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # reap what the run left and was killed above
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if done == 0:
            time.sleep(0.01)
    end_as(status)


def main():
    global STATUS_FD
    # the parent's repr() of plain data (json's import costs 15 ms a run); written by the trusted parent only
    spec = eval(sys.argv[1], {"__builtins__": {}, "true": True, "false": False, "null": None})
    argv = sys.argv[3:]
    STATUS_FD = spec.get("status_fd", -1)
    if STATUS_FD >= 0:
        os.set_inheritable(STATUS_FD, False)  # closed at the program's exec
    signal.signal(signal.SIGTERM, on_sigterm)
    for procs in spec.get("cgroups", []):
        write(procs, str(os.getpid()))
    if spec.get("namespaces"):
        with_namespaces(spec, argv)
    else:
        if spec.get("network") in ("auto", "required"):  # "auto" comes as "allowed" where the kernel refuses
            call("unshare(CLONE_NEWNET)", libc.unshare(CLONE_NEWNET))
        without_namespaces(spec, argv)


if __name__ == "__main__":
    main()
