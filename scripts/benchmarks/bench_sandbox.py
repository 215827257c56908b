"""Time the sandbox: one ``run_python("print(1)")`` and one ``code_tests`` row of three asserts, medians.

    python scripts/benchmarks/bench_sandbox.py                                  # this checkout
    python scripts/benchmarks/bench_sandbox.py --repo /tmp/old --python /usr/bin/python3   # another checkout, same program

``--python`` is the program's interpreter (``sandbox.python``; an older checkout picks its own: give the same
one to compare). Prints one line; docs/results.md, "Sandbox".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=".", help="the checkout whose sandbox to time (default: this one)")
    p.add_argument("--python", default="", help="the program's interpreter (sandbox.python)")
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    sys.path.insert(0, args.repo)
    if os.path.exists(os.path.join(args.repo, "grpo", "workers", "sandbox.py")):
        from grpo.workers import sandbox
    else:  # a checkout from before the sandbox moved out of rewards/
        from rewards import sandbox
    from rewards.code_tests import run_tests

    limits = {"python": args.python} if args.python else None
    program = "def add(a, b):\n    return a + b"
    tests = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(2, 2) == 4"]
    sandbox.run_python("print(1)", limits)  # the first run probes the machine
    runs, rows = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        assert sandbox.run_python("print(1)", limits).stdout == "1\n"
        runs.append(time.perf_counter() - t)
    for _ in range(max(1, args.runs // 2)):
        t = time.perf_counter()
        assert run_tests(program, tests, limits=limits) == ["passed"] * 3
        rows.append(time.perf_counter() - t)
    print(f"{args.repo}: run_python median {statistics.median(runs) * 1000:.1f} ms; a 3-assert code_tests row "
          f"median {statistics.median(rows) * 1000:.1f} ms ({args.runs} and {len(rows)} runs)")


if __name__ == "__main__":
    main()
