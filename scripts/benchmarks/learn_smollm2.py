"""Evidence that a real model learns: SmolLM2-135M-Instruct on arithmetic word problems, CPU only.

    python scripts/benchmarks/learn_smollm2.py                 # seeds 0 and 1, in parallel, one CPU thread each
    python scripts/benchmarks/learn_smollm2.py --seeds 0 1 2 --threads 2 [key=value ...]

Fetches the model if needed (scripts/fetch_smollm2.py), starts the reference server
(``ref_client.py``, one for all seeds: the reference is the same frozen model), trains one run
per seed with configs/smollm2_arith.yaml against it (GRPO with the k3 KL term, held-out greedy
accuracy on 200 problems at the start, during training and at the end), stops the server,
then prints a markdown table (accuracy before / after, the problems fixed and broken, a sign
test on them, KL, right answers by kind of problem), and writes it with a plot to
runs/smollm2_arith/summary.md and docs/smollm2_arith.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.training.metrics import read_metrics  # noqa: E402
from grpo.reference.launch import ServerProcess, free_port  # noqa: E402
from grpo.training.configure import needs_reference_server  # noqa: E402


def train(seeds: list[int], config: str, out: Path, threads: int, overrides: list[str]) -> dict[int, float]:
    """One single-rank run per seed, all at once; returns each run's wall time."""
    procs = {}
    for seed in seeds:
        run = out / f"seed-{seed}"
        run.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # train.py runs as a world of one by itself
        cmd = [sys.executable, "train.py", "--config", config, f"train.seed={seed}", f"train.output_dir={run}",
               *overrides]
        print("$", " ".join(cmd), f"  > {run / 'train.log'}", flush=True)
        log = open(run / "train.log", "w")
        procs[seed] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), time.time(), log)
    walls = {}
    for seed, (proc, t0, log) in procs.items():
        rc = proc.wait()
        walls[seed] = time.time() - t0
        log.close()
        if rc != 0:
            sys.exit(f"seed {seed} failed (exit {rc}); see {out / f'seed-{seed}' / 'train.log'}")
    return walls


def train_with_reference(seeds: list[int], config: str, out: Path, threads: int, overrides: list[str]) -> dict[int, float]:
    """Start one reference server when the config's algorithm needs it, train every seed against it, stop it."""
    if not needs_reference_server(config, overrides):
        return train(seeds, config, out, threads, overrides)
    out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(["--config", config, *overrides], port=free_port(), log_path=out / "ref_server.log",
                           env={"OMP_NUM_THREADS": str(threads)})
    print(f"$ python ref_client.py --config {config} --port {server.port}   > {server.log_path}", flush=True)
    server.start(timeout=300)
    print(f"reference server healthy at {server.url}", flush=True)
    try:
        return train(seeds, config, out, threads, [*overrides, f"ref.url={server.url}"])
    finally:
        print(f"reference server stopped (exit {server.stop()})", flush=True)


def sign_test(fixed: int, broken: int) -> float:
    """Two-sided exact binomial p-value of fixed vs broken problems (McNemar's exact test)."""
    n, k = fixed + broken, min(fixed, broken)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def correct_by_index(path: Path) -> dict[int, bool]:
    return {r["index"]: bool(r["correct"]) for r in map(json.loads, path.read_text().splitlines())}


# The arithmetic task's problem kinds (grpo/data/tasks.py), told apart by their wording; the first match wins.
KINDS = [("a + b - c, two steps", "then gives"), ("a + b", "more. How many"), ("a - b", "away. How many"),
         ("a * b", " bags with "), ("a·b / b", " equally among ")]


def kind_of(prompt: str) -> str:
    return next((name for name, phrase in KINDS if phrase in prompt), "other")


def by_kind(runs: dict[int, Path]) -> str:
    """Held-out problems answered right, by kind: before (the same for every seed: greedy) and after, per seed."""
    def counts(path: Path) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = {}
        for r in map(json.loads, path.read_text().splitlines()):
            c = out.setdefault(kind_of(r["prompt"]), [0, 0])
            c[0] += bool(r["correct"])
            c[1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    first = {seed: sorted((run / "eval").glob("step-*.jsonl"), key=lambda p: int(p.stem.split("-")[1])) for seed, run in runs.items()}
    before = counts(next(iter(first.values()))[0])
    after = {seed: counts(files[-1]) for seed, files in first.items()}
    lines = ["| problems | right before | " + " | ".join(f"seed {s} after" for s in runs) + " |",
             "|---|---|" + "---|" * len(runs)]
    for name in [k for k, _ in KINDS[1:]] + [KINDS[0][0], "other"]:  # the two-step kind last
        if name in before:
            right, n = before[name]
            lines.append(f"| {name} ({n}) | {right} | " + " | ".join(str(after[s].get(name, (0, 0))[0]) for s in runs) + " |")
    return "\n".join(lines)


def summarize(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    (first_step, before), (last_step, after) = evals[0], evals[-1]
    a, b = correct_by_index(run / "eval" / f"step-{first_step}.jsonl"), correct_by_index(run / "eval" / f"step-{last_step}.jsonl")
    fixed = sum(b[i] and not a[i] for i in a)
    broken = sum(a[i] and not b[i] for i in a)
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    k = max(1, len(rewards) // 5)
    kl = [r["kl"] for r in rows if "kl" in r]  # k3 estimate of KL(policy || reference), mean per token
    ref_s = [r["time/reference"] for r in rows if "time/reference" in r]
    step_s = [r["time/step"] for r in rows if "time/step" in r]
    return {"steps": last_step, "n": len(a), "before": before, "after": after, "fixed": fixed, "broken": broken,
            "p": sign_test(fixed, broken), "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
            "kl_last": sum(kl[-k:]) / len(kl[-k:]) if kl else float("nan"),
            "ref_share": sum(ref_s) / sum(step_s) if ref_s and step_s else 0.0,
            "evals": evals, "rewards": rewards, "kl": kl}


def table(results: dict[int, dict], walls: dict[int, float]) -> str:
    lines = ["| seed | steps | held-out problems | accuracy before | accuracy after | gain | fixed / broken | "
             "sign test p | train reward, first → last 20% | KL, last 20% | reference share of step | wall time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seed, s in results.items():
        lines.append(f"| {seed} | {s['steps']} | {s['n']} | {s['before']:.3f} | {s['after']:.3f} | "
                     f"{s['after'] - s['before']:+.3f} | {s['fixed']} / {s['broken']} | {s['p']:.1e} | "
                     f"{s['reward_first']:.3f} → {s['reward_last']:.3f} | {s['kl_last']:.4f} | {100 * s['ref_share']:.0f}% | "
                     f"{f'{walls[seed] / 60:.0f} min' if seed in walls else 'not timed (--report-only)'} |")
    gains = [s["after"] - s["before"] for s in results.values()]
    mean = sum(gains) / len(gains)
    n = next(iter(results.values()))["n"]
    p0 = next(iter(results.values()))["before"]
    se = math.sqrt(p0 * (1 - p0) / n)
    lines.append("")
    lines.append(f"Gain over {len(gains)} seeds: mean {mean:+.3f}, range {min(gains):+.3f} to {max(gains):+.3f}. "
                 f"Sampling noise of one accuracy on {n} problems: ±{se:.3f} (binomial standard error at {p0:.2f}).")
    return "\n".join(lines)


def plot(results: dict[int, dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(r: list[float], w: int = 5) -> list[float]:
        return [sum(r[max(0, i - w + 1) : i + 1]) / len(r[max(0, i - w + 1) : i + 1]) for i in range(len(r))]

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.2))
    for seed, s in results.items():
        ax1.plot(*zip(*s["evals"]), marker="o", label=f"seed {seed}")
        ax2.plot(range(1, len(s["rewards"]) + 1), smooth(s["rewards"]), label=f"seed {seed}")
        ax3.plot(range(1, len(s["kl"]) + 1), smooth(s["kl"]), label=f"seed {seed}")
    ax1.set_title(f"held-out accuracy, greedy ({next(iter(results.values()))['n']} problems)")
    ax2.set_title("training reward (sampled, 5-step mean)")
    ax3.set_title("KL to the reference (k3, 5-step mean)")
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2_arith.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (runs go in parallel)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "smollm2_arith")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "smollm2_arith.png")
    p.add_argument("--report-only", action="store_true", help="summarize existing runs without training")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = p.parse_args()

    model = ROOT / "models" / "smollm2-135m-instruct"
    if not args.report_only and not (model / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_smollm2.py")], check=True)
    t0 = time.time()
    walls = {} if args.report_only else train_with_reference(args.seeds, args.config, args.out, args.threads,
                                                              args.overrides)
    results = {seed: summarize(args.out / f"seed-{seed}") for seed in args.seeds}
    text = table(results, walls) + "\n\nRight answers by kind of problem (held-out, greedy):\n\n" + by_kind(
        {seed: args.out / f"seed-{seed}" for seed in args.seeds})
    plot(results, args.plot)
    (args.out / "summary.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nplot: {args.plot}   table: {args.out / 'summary.md'}   total wall time: {(time.time() - t0) / 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
