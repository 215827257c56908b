"""What measure_memory.py and zero3_memory.py share: each side of a comparison runs in a process of its own
(its environment set here), a failed side prints its output's tail, and the results are written as
JSON and a Markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


def rss_mb() -> float:
    """This process's resident memory now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def status_mb(key: str) -> float:
    """A memory line of /proc/self/status (``VmHWM``: the peak RSS), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def side_env(threads: int, mmap_threshold: Optional[int]) -> dict[str, str]:
    """The environment of one side: its thread count, and glibc's mmap threshold when one is given
    (so that peak RSS follows live memory)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def run_side(cmd: list[str], env: dict[str, str]) -> Optional[subprocess.CompletedProcess]:
    """Run one side; None (after printing its output's tail) when it failed."""
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return None
    return proc


def write_results(out: Path, stem: str, results: dict, text: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(text + "\n")
    print()
    print(text)
