"""`make demo`: train the tiny model on the built-in task, then report.

Ranks: one per GPU where torch sees CUDA, else 2 DeepSpeed CPU ranks (``--ranks`` overrides).

The reference model (for the KL term) runs in its own process: the demo starts
``ref_client.py``, waits until it is healthy, trains against it (``ref.url``) and stops it.
With ``model.lora=...`` no server is started: the reference is the policy with its adapters off.
Prints reward and the share of completions that stopped (EOS) at start and end, steps and time, and the
plot's path; exits non-zero when the run did not learn to copy and stop (last-10% mean reward >= 0.8 and
>= 5x the first-10% mean, and >= 80% of the last 10%'s completions end with EOS).
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

from grpo.training.metrics import read_metrics  # noqa: E402
from grpo.reference.launch import ServerProcess, free_port  # noqa: E402
from grpo.training.configure import needs_reference_server  # noqa: E402


def launcher() -> list[str]:
    exe = Path(sys.executable).with_name("deepspeed")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_ranks() -> int:
    """One rank per GPU torch sees; 2 CPU ranks without one."""
    import torch

    return torch.cuda.device_count() if cuda_available() else 2


def summarize(metrics_path: Path) -> dict:
    rows = read_metrics(metrics_path)
    k = max(1, len(rows) // 10)
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    stopped_first = 1 - sum(r["completion/truncated_frac"] for r in rows[:k]) / k
    stopped_last = 1 - sum(r["completion/truncated_frac"] for r in rows[-k:]) / k
    ref = [r for r in rows if r.get("ref/requests")]
    per_step = {key: sum(r[key] for r in ref) / max(1, len(ref)) for key in ("ref/latency", "ref/bytes_sent", "ref/bytes_received")}
    return {"steps": len(rows), "first": first, "last": last, "stopped_first": stopped_first,
            "stopped_last": stopped_last, "ref_steps": len(ref), **per_step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--ranks", type=int, default=None, help="default: one per GPU, else 2 CPU ranks")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    ranks = args.ranks or default_ranks()

    out = ROOT / args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    server = None
    overrides = list(args.overrides)
    if needs_reference_server(args.config, overrides):
        # One core each for the two ranks and the server: no thread oversubscription on a small CPU box.
        server = ServerProcess(["--config", args.config, *overrides], port=free_port(),
                               log_path=out / "ref_server.log", env={"OMP_NUM_THREADS": "1"})
        print(f"$ python ref_client.py --config {args.config} --port {server.port}   (log: {server.log_path})", flush=True)
        server.start(timeout=180)
        print(f"reference server healthy at {server.url}", flush=True)
        overrides.append(f"ref.url={server.url}")
    # --quiet: the launcher's own INFO lines (its command, world info, each process's exit) stay out of the demo's
    # output; without a GPU, DS_ACCELERATOR=cpu spares every process DeepSpeed's "Setting accelerator to CPU" line
    cmd = launcher() + ["--quiet", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 1000),
                        "train.py", "--config", args.config, f"train.output_dir={out}", *overrides]
    env = dict(os.environ)
    if not cuda_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
    finally:
        if server is not None:
            code = server.stop()
            print(f"reference server stopped (exit {code})", flush=True)
    elapsed = time.time() - t0
    if proc.returncode != 0:
        print(f"training failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    s = summarize(out / "metrics.jsonl")
    ok = s["last"] >= 0.8 and s["last"] >= 5 * s["first"] and s["stopped_last"] >= 0.8
    print()
    print("| ranks | steps | reward, first 10% | reward, last 10% | ratio | stopped (EOS), first 10% | last 10% | wall time |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {ranks} | {s['steps']} | {s['first']:.3f} | {s['last']:.3f} | {s['last'] / max(s['first'], 1e-9):.1f}x "
          f"| {s['stopped_first']:.0%} | {s['stopped_last']:.0%} | {elapsed:.0f} s |")
    if s["ref_steps"]:
        print(f"\nreference server: {s['ref_steps']} steps, per step on rank 0: {1000 * s['ref/latency']:.1f} ms latency, "
              f"{s['ref/bytes_sent'] / 1024:.1f} KiB sent, {s['ref/bytes_received'] / 1024:.1f} KiB received")
    print(f"\nplot: {out / 'metrics.png'}")
    print(f"metrics: {out / 'metrics.jsonl'}   samples: {out / 'samples.jsonl'}")
    print("learned: yes" if ok else "learned: NO (needs reward, last 10% >= 0.8 and >= 5x the first 10%, and >= 80% "
          "of the last 10%'s completions stopped with EOS)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
