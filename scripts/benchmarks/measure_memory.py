"""Peak memory of a few training steps: full fine-tuning against LoRA, same settings, beta > 0.

    python scripts/benchmarks/measure_memory.py                         # SmolLM2-135M-Instruct, beta 0.04, 3 steps each
    python scripts/benchmarks/measure_memory.py --steps 5 --max-new 128 --lora '{r: 16, alpha: 32}' [key=value ...]

Each side runs in its own process, one after the other (``--child``), as a world of one: the trainer
is built from configs/smollm2_arith.yaml (the arithmetic task) with the KL term on (beta 0.04) and no
reference server, every layer trained (``model.freeze_bottom_layers=0``), no evaluation, rewards in
the trainer's process, and every completion exactly ``--max-new`` tokens (``rollout.ignore_eos``) so
both sides do the same work. Full fine-tuning keeps the in-process reference (a frozen copy of the
model); LoRA's reference is the policy with its adapters off. Reported per side: the process's peak
RSS over the whole run (setup included), the peak of each step alone (the kernel's VmHWM, restarted
before the step; the first step has no Adam moments yet, AdamW creates them at its first update), its
RSS after setup, and on a GPU the peak of
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``; the median step time; parameter counts.
Writes JSON and a Markdown table to ``--out`` (default runs/memory/).

Peak RSS on a CPU counts what the allocator holds, not only what is live: glibc keeps freed memory
for reuse, and by default its mmap threshold rises after the first large frees, so later steps'
activations come from a heap that grows by fragmentation. ``--mmap-threshold BYTES`` fixes glibc's
threshold (``MALLOC_MMAP_THRESHOLD_``) in both children: every tensor above it is mapped and
unmapped on its own, and peak RSS follows live memory much more closely.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from memory_sides import rss_mb, run_side, side_env, status_mb, write_results  # noqa: E402 (beside this file)
DEFAULT_LORA = "{r: 16, alpha: 32}"


def _reset_peak() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) for this process; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args) -> dict:
    import torch

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    ov = ["ref.url=null", "model.freeze_bottom_layers=0", f"model.name_or_path={args.model}", f"model.dtype={args.dtype}",
          f"algo.beta={args.beta}", "eval.every=0", "reward_pool.num_workers=0", "logging.progress_bar=false",
          "logging.plot=false", f"train.max_steps={args.steps}", f"train.output_dir={args.out / args.child}",
          f"rollout.max_completion_length={args.max_new}", "rollout.ignore_eos=true",
          f"rollout.prompts_per_step={args.prompts}", f"rollout.num_generations={args.group}",
          f"train.micro_batch_size={args.micro_batch}", *args.overrides]
    if args.child == "lora":
        ov.append(f"model.lora={args.lora}")
    cfg = load_config(args.config, None, ov)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    after_setup = rss_mb()
    setup_peak = status_mb("VmHWM")
    times, step_peaks = [], []
    for _ in range(args.steps):
        resettable = _reset_peak()
        t0 = time.perf_counter()
        m = trainer.train_step()
        times.append(time.perf_counter() - t0)
        step_peaks.append(status_mb("VmHWM") if resettable else float("nan"))
        trainer.step += 1
    trainer.close()
    params = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    # restarting VmHWM restarts ru_maxrss too: the whole run's peak is the largest of the parts
    peak = max([setup_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                *[x for x in step_peaks if x == x]])
    out = {"side": args.child, "peak_rss_mb": peak,
           "rss_after_setup_mb": after_setup, "step_peak_rss_mb": step_peaks, "step_s_median": statistics.median(times),
           "steps": args.steps,
           "params": params, "trainable": trainable, "reference": trainer.reference.kind, "kl_last": m.get("kl"),
           "device": str(trainer.device), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def table(results: dict[str, dict], args) -> str:
    full, lora = results["full"], results["lora"]
    head = (f"{args.model}, {args.dtype}, beta = {args.beta}, {args.prompts} prompts x G = {args.group}, {args.max_new} "
            f"new tokens (EOS ignored), micro-batch {args.micro_batch}, {args.steps} steps, device {full['device']}, "
            f"{full['threads']} thread(s); LoRA {args.lora}; glibc mmap threshold "
            f"{args.mmap_threshold if args.mmap_threshold is not None else 'default (dynamic)'}")
    for side in (full, lora):
        side["first_step_peak_rss_mb"] = side["step_peak_rss_mb"][0]
        side["later_steps_peak_rss_mb"] = max(side["step_peak_rss_mb"][1:], default=float("nan"))
    rows = [("peak RSS, whole run (MiB)", "peak_rss_mb", "{:.0f}"),
            ("peak RSS of the first step (MiB; no Adam moments yet)", "first_step_peak_rss_mb", "{:.0f}"),
            ("peak RSS of each later step, largest (MiB)", "later_steps_peak_rss_mb", "{:.0f}"),
            ("RSS after setup (MiB)", "rss_after_setup_mb", "{:.0f}")]
    if "cuda_max_allocated_mb" in full:
        rows += [("peak CUDA allocated (MiB)", "cuda_max_allocated_mb", "{:.0f}"),
                 ("peak CUDA reserved (MiB)", "cuda_max_reserved_mb", "{:.0f}")]
    rows += [("step time, median (s)", "step_s_median", "{:.2f}")]
    lines = [head, "", "| | full fine-tune | LoRA | LoRA / full |", "|---|---|---|---|"]
    for name, key, fmt in rows:
        lines.append(f"| {name} | {fmt.format(full[key])} | {fmt.format(lora[key])} | {lora[key] / full[key]:.2f} |")
    lines.append(f"| trainable parameters | {full['trainable']:,} | {lora['trainable']:,} | "
                 f"{lora['trainable'] / full['trainable']:.4f} |")
    lines.append(f"| reference | {full['reference']} (a frozen copy) | {lora['reference']} (no copy) | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2_arith.yaml"))
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--lora", default=DEFAULT_LORA, help="the model.lora mapping of the LoRA side")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each side")
    p.add_argument("--mmap-threshold", type=int, default=None,
                   help="MALLOC_MMAP_THRESHOLD_ for both sides (glibc), e.g. 65536; default: glibc's own")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "memory")
    p.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both sides")
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    if not Path(args.model).exists() and args.model == "models/smollm2-135m-instruct":
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_smollm2.py")], check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for side in ("full", "lora"):
        cmd = [sys.executable, __file__, "--child", side] + [a for a in sys.argv[1:]]
        env = side_env(args.threads, args.mmap_threshold)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        proc = run_side(cmd, env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None) if proc else None
        if line is None:
            if proc is not None:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        results[side] = json.loads(line[len("RESULT "):])
        print(f"{side}: {results[side]}", flush=True)
    write_results(args.out, "memory", results, table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
