"""Agents on a CPU: mt-grpo learns the calculator environment, gigpo the maze (the tiny model).

    python scripts/benchmarks/learn_agents.py mt-grpo      # configs/mt-grpo.yaml: two turns, a calculator call
    python scripts/benchmarks/learn_agents.py gigpo        # configs/gigpo.yaml: a 3x3 maze, one action per turn
    python scripts/benchmarks/learn_agents.py gigpo --ranks 2    # the same through the deepspeed launcher, 2 CPU ranks

Trains the preset (key=value overrides after the name), then prints the reward of the first and last
10% of steps and the environment's metrics, writes OUT/summary.md and OUT/agents.png (reward, turns,
tool calls / invalid actions), and exits 1 when the run did not learn (the thresholds below).
OUT defaults to runs/agents/NAME.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> {metric: (the mean that the last 10% of steps must reach, the rise over the first 10% it must show)};
# mt-grpo's reward/exact/mean is the exact-answer accuracy (no partial credit in it)
THRESHOLDS = {"mt-grpo": {"reward/mean": (1.2, 0.8), "reward/exact/mean": (0.25, 0.2)},
              "gigpo": {"reward/mean": (0.5, 0.5)}}
PANELS = {
    "mt-grpo": [("reward/mean", "reward R^T + R^O (max 2.2)"), ("reward/turn/mean", "turn reward R^T"),
                ("reward/exact/mean", "exact-answer accuracy"), ("reward/outcome/mean", "outcome reward R^O (max 1.2)"),
                ("env/tool_errors", "tool errors per step")],
    "gigpo": [("reward/mean", "episode return"), ("env/turns_mean", "turns per trajectory"),
              ("env/invalid_per_trajectory", "invalid actions per trajectory"), ("env/step_limit_frac", "step-limit hits")],
}


def plot(rows: list[dict], name: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = PANELS[name]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for ax, (key, title) in zip(axes, panels):
        ax.plot([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    fig.suptitle(f"{name} (tiny model, CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def train_here(name: str, out: Path, overrides: list[str]) -> None:
    from grpo.foundation.dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / f"{name}.yaml", None, [f"train.output_dir={out}", *overrides])
    Trainer(cfg).train()


def train_ranks(name: str, out: Path, overrides: list[str], ranks: int) -> None:
    from grpo.foundation.dist import free_port

    exe = Path(sys.executable).with_name("deepspeed")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd = launcher + ["--num_gpus", str(ranks), "--master_port", str(free_port()), "train.py", "--config",
                      f"configs/{name}.yaml", f"train.output_dir={out}", *overrides]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(THRESHOLDS))
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--out", default=None)
    p.add_argument("--ranks", type=int, default=1, help="> 1: through the deepspeed launcher")
    args = p.parse_args()
    out = Path(args.out or ROOT / "runs" / "agents" / args.name)
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()
    overrides = ["logging.progress_bar=false", *args.overrides]
    t0 = time.time()
    if args.ranks > 1:
        train_ranks(args.name, out, overrides, args.ranks)
    else:
        train_here(args.name, out, overrides)
    wall = time.time() - t0
    from grpo.training.metrics import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    k = max(1, len(rows) // 10)
    avg = lambda part, key: sum(r.get(key, 0.0) for r in part) / len(part)  # noqa: E731
    first, last = avg(rows[:k], "reward/mean"), avg(rows[-k:], "reward/mean")
    checks = [(key, avg(rows[:k], key), avg(rows[-k:], key), need_last, need_rise)
              for key, (need_last, need_rise) in THRESHOLDS[args.name].items()]
    ok = all(b >= need_last and b - a >= need_rise for _, a, b, need_last, need_rise in checks)
    keys = [key for key, _ in PANELS[args.name][1:]]
    lines = [
        f"# {args.name}: {len(rows)} steps, {args.ranks} rank(s), {wall / 60:.1f} min wall",
        "",
        "| | first 10% of steps | last 10% |",
        "|---|---|---|",
        f"| reward | {first:.3f} | {last:.3f} |",
        *[f"| {key} | {avg(rows[:k], key):.3f} | {avg(rows[-k:], key):.3f} |" for key in keys],
        "",
        *[f"threshold {key}: last 10% >= {need_last} and a rise >= {need_rise}: {'PASS' if b >= need_last and b - a >= need_rise else 'FAIL'}"
          for key, a, b, need_last, need_rise in checks],
    ]
    plot(rows, args.name, out / "agents.png")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"plot: {out / 'agents.png'}")
    print(json.dumps({"name": args.name, "first": first, "last": last, "ok": ok, "wall_s": round(wall)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
