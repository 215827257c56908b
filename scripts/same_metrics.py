"""Does a change leave training unchanged? Train the same config at two commits and compare metrics.jsonl.

    python scripts/same_metrics.py --before 8a36640 --algo grpo --steps 20
    python scripts/same_metrics.py --before 8a36640 --algo prorl --steps 20 algo.beta=0.001 algo.reset_every=5

Checks out ``--before`` in a temporary git worktree, runs ``python train.py`` (one rank, one thread,
rewards in-process, fixed seed) there and in this checkout, and compares every metric of every
step except timings (``time/*``, ``tokens_per_sec``) and keys only one side has (listed). Exit 0
when every shared value is equal, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("time/", "tokens_per_sec")


def train(tree: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, "train.py", "--algo", args.algo, "--config", args.config, f"train.max_steps={args.steps}",
           f"train.output_dir={out}", "logging.progress_bar=false", "logging.plot=false", "train.save_every=0",
           "reward_pool.num_workers=0", *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree}: train.py exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare(before: list[dict], after: list[dict]) -> tuple[int, set[str]]:
    if len(before) != len(after):
        raise SystemExit(f"{len(before)} steps before, {len(after)} after")
    differences, one_sided = 0, set()
    for a, b in zip(before, after):
        keys_a = {k for k in a if not k.startswith(TIMING)}
        keys_b = {k for k in b if not k.startswith(TIMING)}
        one_sided |= keys_a ^ keys_b
        for k in sorted(keys_a & keys_b):
            if a[k] != b[k]:
                differences += 1
                print(f"step {a['step']}: {k} {a[k]!r} -> {b[k]!r}")
    return differences, one_sided


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="a commit to compare this checkout with")
    p.add_argument("--algo", default="grpo")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("overrides", nargs="*", help="key=value overrides for both runs")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            before = train(old, Path(tmp) / "run-before", args)
            after = train(ROOT, Path(tmp) / "run-after", args)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    differences, one_sided = compare(before, after)
    print(f"{args.algo}: {len(after)} steps, {differences} differing values "
          f"(timings excluded; keys on one side only: {sorted(one_sided) or 'none'})")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
