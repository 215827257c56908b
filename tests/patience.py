"""How long a test waits before it calls something hung: one setting for the whole suite.

A limit in a test exists to catch a hang, never to measure speed (speed claims live in scripts/bench*.py and
docs/results.md). So every wait polls for progress (a process exited, a step written, a server healthy) and
gives up only far above the slowest time seen on a loaded 2-core machine. GRPO_TEST_PATIENCE multiplies
every limit (e.g. 3 on a machine slower still); it never makes a test pass that would otherwise fail.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("GRPO_TEST_PATIENCE", "1"))
if not SCALE > 0:
    raise ValueError(f"GRPO_TEST_PATIENCE={os.environ['GRPO_TEST_PATIENCE']!r} must be a number > 0, e.g. 1 or 3")


def patience(seconds: float) -> float:
    """``seconds`` scaled by GRPO_TEST_PATIENCE."""
    return seconds * SCALE


LAUNCH_S = patience(1800)  # a whole launched run (the deepspeed launcher, train.py, a script) to its end
SERVER_S = patience(600)  # a server process to answer /health (imports and loading, on a busy machine)
STEP_S = patience(600)  # a running trainer to write its next step
WAIT_S = patience(120)  # an in-process condition polled for (a request running, a slot freed)
