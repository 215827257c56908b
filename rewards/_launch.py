"""The sandbox's launcher (rewards/sandbox.py): ``python -I -S _launch.py SPEC -- ARGV...``.

Runs in the new session the parent made, applies SPEC (a JSON mapping) to itself, then runs ARGV in a child
(fork + exec; the launcher waits and exits as the child did), which inherits all of it: a new network
namespace, the resource limits, the unprivileged user. Standard library only, no imports from the project
(it runs with ``-I -S``). Exit code 121 (and a line on stderr) when a step that was asked for fails: nothing
runs without the limits it was given.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNET = 0x40000000


def fail(msg):
    os.write(2, f"sandbox launcher: {msg}\n".encode())
    os._exit(121)


def main():
    spec = json.loads(sys.argv[1])
    argv = sys.argv[3:]
    if spec.get("network") in ("auto", "required"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            fail(f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
    mb = 1024 * 1024
    limits = [(resource.RLIMIT_CORE, 0)]
    if spec.get("memory_mb"):
        limits.append((resource.RLIMIT_AS, spec["memory_mb"] * mb))
    if spec.get("cpu_seconds"):
        limits.append((resource.RLIMIT_CPU, spec["cpu_seconds"]))
    if spec.get("file_size_mb"):
        limits.append((resource.RLIMIT_FSIZE, spec["file_size_mb"] * mb))
    if spec.get("open_files"):
        limits.append((resource.RLIMIT_NOFILE, spec["open_files"]))
    if spec.get("processes"):
        limits.append((resource.RLIMIT_NPROC, spec["processes"]))
    for which, value in limits:
        try:
            # soft = hard: the program cannot raise it back; CPU: SIGXCPU at the soft limit, SIGKILL 1 s later
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))
        except (ValueError, OSError) as e:
            fail(f"setrlimit({which}, {value}) failed: {e}")
    if spec.get("uid") is not None:
        try:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        except OSError as e:
            fail(f"dropping to uid {spec['uid']} failed: {e}")
    # the program runs in a child: its parent (os.getppid()) is this launcher, not the trainer's process
    try:
        pid = os.fork()
    except OSError as e:
        fail(f"fork failed: {e}")
    if pid == 0:
        try:
            os.execv(argv[0], argv)
        except OSError as e:
            fail(f"exec {argv[0]!r} failed: {e}")
    status = 0
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(121)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):  # end the same way, so that the parent reads the signal
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 121)


if __name__ == "__main__":
    main()
