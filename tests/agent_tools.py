"""Misbehaving tools for tests/test_multiturn.py (a light module: sandbox workers import it)."""

from __future__ import annotations

import time


def hang(args: str, **_) -> str:
    time.sleep(600)  # far beyond any test's bound: only the tool timeout ends it
    return "never"


def boom(args: str, **_) -> str:
    raise RuntimeError("tool failure")


def garbage(args: str, **_):
    return {"not": "a string"}


def huge(args: str, **_) -> str:
    return "9" * 100_000


def hog(args: str, **_) -> str:
    """Allocates 2 GiB when asked to (past a tool worker's env.tool_limits.memory_mb in tests/test_sandbox.py)."""
    return str(len(bytearray(2 << 30))) if args == "hog" else "fine"


def shout(args: str, **_) -> str:
    """Raises with a 1 MB message (its end names the error)."""
    raise ValueError("x" * 1_000_000 + " THE END")


def spawn_and_hang(args: str, **_) -> str:
    """Starts a child that sleeps 600 s (its pid written to the file ``args``), then hangs itself."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(args, "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
    return "never"


def rendezvous(args: str, dir: str, n: int, **_) -> str:
    """Waits (up to 60 s) until ``n`` calls have started (each leaves a file in ``dir``), then answers how many
    it saw: calls made one at a time never meet, and time out."""
    import os
    import uuid

    open(os.path.join(dir, f"{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = len(os.listdir(dir))
        if seen >= n:
            return str(seen)
        time.sleep(0.01)
    return "alone"


def echo(args: str, **_) -> str:
    return args


def nap(args: str, seconds: float = 0.5, **_) -> str:
    """Sleeps ``seconds``, then answers 7 (issue 30, item 16's measurement: a slow tool)."""
    time.sleep(seconds)
    return "7"
