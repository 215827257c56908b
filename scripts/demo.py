"""`make demo`: train the tiny model on the built-in task with 2 DeepSpeed CPU ranks, then report.

Prints reward at start and end, steps and time, and the plot's path; exits non-zero when
the run did not learn (last-10% mean reward >= 0.8 and >= 5x the first-10% mean).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo.metrics import read_metrics  # noqa: E402


def launcher() -> list[str]:
    exe = Path(sys.executable).with_name("deepspeed")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]


def summarize(metrics_path: Path) -> dict:
    rows = read_metrics(metrics_path)
    k = max(1, len(rows) // 10)
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    return {"steps": len(rows), "first": first, "last": last}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    out = ROOT / args.output_dir
    cmd = launcher() + ["--num_gpus", str(args.ranks), "--master_port", str(29500 + os.getpid() % 1000),
                        "train.py", "--config", args.config, f"train.output_dir={out}", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT)
    elapsed = time.time() - t0
    if proc.returncode != 0:
        print(f"training failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    s = summarize(out / "metrics.jsonl")
    ok = s["last"] >= 0.8 and s["last"] >= 5 * s["first"]
    print()
    print("| steps | reward, first 10% | reward, last 10% | ratio | wall time |")
    print("|---|---|---|---|---|")
    print(f"| {s['steps']} | {s['first']:.3f} | {s['last']:.3f} | {s['last'] / max(s['first'], 1e-9):.1f}x | {elapsed:.0f} s |")
    print(f"\nplot: {out / 'metrics.png'}")
    print(f"metrics: {out / 'metrics.jsonl'}   samples: {out / 'samples.jsonl'}")
    print("learned: yes" if ok else "learned: NO (needs last >= 0.8 and >= 5x first)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
