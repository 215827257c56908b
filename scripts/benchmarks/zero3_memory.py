"""Host memory of ZeRO-3 over 2 ranks: the policy and the in-process reference built partitioned from the
start (``train.zero3_init=true``, the default) against whole on every rank first (``false``).

    python scripts/benchmarks/zero3_memory.py --make-model DIR      # a random-weight model of SmolLM2-135M's shape
    python scripts/benchmarks/zero3_memory.py --model DIR [--steps 2] [--mmap-threshold 65536] [key=value ...]

Each side is one launch of 2 CPU ranks (``deepspeed --num_gpus 2 ... --child SIDE``), one after the
other, with the trainer built from configs/smollm2_arith.yaml: ZeRO-3, fp32, the KL term on (beta 0.04,
so there is an in-process reference), every layer trained, no evaluation, rewards in the trainer's
process, every completion exactly ``--max-new`` tokens. Every rank reports:

* the bytes of weight storage it holds: the policy as loaded (before DeepSpeed's engine), the policy in
  its engine, and the reference;
* the trainer's construction phases, each as the rise of the peak RSS (the kernel's VmHWM, restarted
  at the phase's start) over the RSS at its start: loading the policy, building its engine (DeepSpeed's
  partitioning of a whole model, the optimizer's fp32 partitions and Adam moments), building the
  reference; the weights of a model are read once (every parameter summed) inside its phase, so a
  memory-mapped whole load counts in full, as its first forward would make it;
* the peak of the whole construction over the RSS before it (``weights peak``: imports, the process
  group and the tokenizer are in the baseline), and the peak RSS of each training step and of the run.

``--mmap-threshold BYTES`` fixes glibc's mmap threshold (``MALLOC_MMAP_THRESHOLD_``) on both sides:
every block above it is mapped and unmapped on its own, so RSS follows live memory instead of what the
allocator keeps after frees (see scripts/benchmarks/measure_memory.py). Writes JSON and a Markdown table to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from memory_sides import rss_mb, run_side, side_env, status_mb, write_results  # noqa: E402 (beside this file)
SIDES = {"whole": "false", "partitioned": "true"}  # side -> train.zero3_init


def hwm_mb() -> float:
    return status_mb("VmHWM")


def reset_peak() -> None:
    """Restart the kernel's peak-RSS count (VmHWM; ru_maxrss restarts with it)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_model(out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
    LlamaForCausalLM(cfg).save_pretrained(out)


def held_bytes(model) -> int:
    """Bytes of weight storage this rank holds: a ZeRO-3 parameter's own partition, else the whole tensor."""
    return sum((t := getattr(p, "ds_tensor", p.data)).numel() * t.element_size() for p in model.parameters())


def read_all(model) -> None:
    """Read every weight this rank holds (a memory-mapped load is then resident, as after a forward)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            getattr(p, "ds_tensor", p.data).float().sum()


def child(args) -> None:
    import gc

    import grpo.training.trainer as trainer_mod
    from grpo.foundation import dist
    from grpo.training import deepspeed_engine as ds
    from grpo.training.configure import load_config

    ds.init_distributed()
    if args.buckets:  # DeepSpeed's ZeRO-3 working sizes (elements): gathered weights kept live, gradient bucket
        base_config = ds.deepspeed_config

        def with_buckets(c):
            conf = base_config(c)
            conf["zero_optimization"].update(stage3_max_live_parameters=args.buckets, stage3_prefetch_bucket_size=args.buckets,
                                             reduce_bucket_size=args.buckets)
            return conf

        ds.deepspeed_config = with_buckets
    cfg = load_config(args.config, None, [
        "ref.url=null", "model.freeze_bottom_layers=0", f"model.name_or_path={args.model}", "model.dtype=fp32",
        "train.zero_stage=3", f"train.zero3_init={SIDES[args.child]}", f"algo.beta={args.beta}", "eval.every=0",
        "reward_pool.num_workers=0", "logging.progress_bar=false", "logging.plot=false",
        f"train.max_steps={args.steps}", f"train.output_dir={args.out / args.child}",
        f"rollout.max_completion_length={args.max_new}", "rollout.ignore_eos=true",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.num_generations={args.group}",
        f"train.micro_batch_size={args.micro_batch}", *args.overrides])
    out: dict = {"side": args.child, "rank": dist.rank()}
    peaks: list[float] = []  # every phase restarts VmHWM: an outer peak is the largest of its phases' and its own

    def phase(name, fn, model_of=None):
        """``fn`` measured: the rise of the peak RSS over the RSS at its start (a model's weights read inside
        it), and the bytes of weights held; a phase that runs again (every step) keeps its largest rise."""
        def run(*a, **k):
            start = rss_mb()
            reset_peak()
            result = fn(*a, **k)
            model = model_of(result) if model_of else None
            if model is not None:
                read_all(model)
                out[f"{name}_held_mb"] = held_bytes(model) / 2**20
            top = hwm_mb()
            peaks.append(top)
            out[f"{name}_rise_mb"] = max(out.get(f"{name}_rise_mb", 0.0), top - start)
            return result
        return run

    trainer_mod.load_policy = phase("policy_load", trainer_mod.load_policy, lambda m: m)
    trainer_mod.load_partitioned = phase("policy_load", trainer_mod.load_partitioned, lambda m: m)
    ds.build_engine = phase("policy_engine", ds.build_engine, lambda r: r[0].module)
    trainer_mod.make_reference = phase("reference", trainer_mod.make_reference, lambda h: h.impl.model)
    gc.collect()
    base = rss_mb()
    reset_peak()
    trainer = trainer_mod.Trainer(cfg)
    out["rss_before_build_mb"] = base
    out["build_peak_mb"] = max([*peaks, hwm_mb()])
    out["build_rise_mb"] = out["build_peak_mb"] - base
    out["rss_after_build_mb"] = rss_mb()
    # the parts of a step
    trainer.rollout.rollout = phase("step_generation", trainer.rollout.rollout)
    if trainer.reference is not None:
        trainer.reference.submit = phase("step_reference", trainer.reference.submit)
    trainer.policy_logprobs = phase("step_old_logprobs", trainer.policy_logprobs)
    trainer.accumulate_gradients = phase("step_forward_backward", trainer.accumulate_gradients)
    trainer.engine.step = phase("step_optimizer", trainer.engine.step)
    steps, times = [], []
    for _ in range(args.steps):
        peaks.clear()
        reset_peak()
        t0 = time.perf_counter()
        m = trainer.train_step()
        times.append(time.perf_counter() - t0)
        steps.append(max([*peaks, hwm_mb()]))
        trainer.step += 1
        out.setdefault("loss", []).append(m.get("loss"))
        out.setdefault("kl", []).append(m.get("kl"))
        out.setdefault("reward", []).append(m.get("reward/mean"))
    trainer.close()
    out["step_peak_mb"] = steps
    out["run_peak_mb"] = max([out["build_peak_mb"], *steps, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    out["step_s"] = times
    out["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters())
    rows = dist.all_gather_object(out)
    if dist.is_main():
        (args.out / f"{args.child}.json").write_text(json.dumps(rows, indent=1))
    dist.shutdown()


def table(results: dict, args) -> str:
    def cell(side, key, fmt="{:.0f}"):
        return " / ".join(fmt.format(r[key]) for r in results[side])

    w, p = results["whole"], results["partitioned"]
    head = (f"{args.model} ({w[0]['params'] / 1e6:.1f} M parameters), fp32, ZeRO-3, 2 CPU ranks (rank 0 / rank 1), "
            f"beta {args.beta} (in-process reference), {args.prompts} prompts x G = {args.group}, {args.max_new} new tokens, "
            f"micro-batch {args.micro_batch}, {args.steps} steps; ZeRO-3 buckets {args.buckets or 'DeepSpeed defaults'}; glibc mmap threshold "
            f"{args.mmap_threshold if args.mmap_threshold is not None else 'default (dynamic)'}")
    rows = [("weights held: policy as loaded (MiB)", "policy_load_held_mb"),
            ("weights held: policy in its engine (MiB)", "policy_engine_held_mb"),
            ("weights held: reference (MiB)", "reference_held_mb"),
            ("peak rise, loading the policy (MiB)", "policy_load_rise_mb"),
            ("peak rise, the policy's engine (MiB)", "policy_engine_rise_mb"),
            ("peak rise, building the reference (MiB)", "reference_rise_mb"),
            ("peak rise of the whole construction over the RSS before it (MiB)", "build_rise_mb"),
            ("RSS before construction (MiB)", "rss_before_build_mb"),
            ("RSS after construction (MiB)", "rss_after_build_mb"),
            ("in a step, peak rise: generation (MiB)", "step_generation_rise_mb"),
            ("in a step, peak rise: reference log-probs (MiB)", "step_reference_rise_mb"),
            ("in a step, peak rise: forward + backward (MiB)", "step_forward_backward_rise_mb"),
            ("in a step, peak rise: optimizer step (MiB)", "step_optimizer_rise_mb"),
            ("peak RSS of the whole run (MiB)", "run_peak_mb")]
    if "step_old_logprobs_rise_mb" in w[0]:
        rows.insert(-2, ("in a step, peak rise: old log-probs (MiB)", "step_old_logprobs_rise_mb"))
    lines = [head, "", "| | whole, then partitioned | partitioned from the start | ratio (rank 0) |", "|---|---|---|---|"]
    for name, key in rows:
        ratio = f"{p[0][key] / w[0][key]:.2f}" if w[0][key] else "-"
        lines.append(f"| {name} | {cell('whole', key)} | {cell('partitioned', key)} | {ratio} |")
    for i in range(args.steps):
        ws, ps = (" / ".join(f"{r['step_peak_mb'][i]:.0f}" for r in side) for side in (w, p))
        lines.append(f"| peak RSS of step {i + 1} (MiB) | {ws} | {ps} | {p[0]['step_peak_mb'][i] / w[0]['step_peak_mb'][i]:.2f} |")
    lines.append("")
    for key in ("reward", "loss", "kl"):
        diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(w[0][key], p[0][key]))
        lines.append(f"Step {key}, whole: {w[0][key]}; partitioned: {p[0][key]} (largest relative difference {diff:.1e})")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--make-model", help="write a random-weight model of SmolLM2-135M's shape to this folder and exit")
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2_arith.yaml"))
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--mmap-threshold", type=int, default=None,
                   help="MALLOC_MMAP_THRESHOLD_ for both sides (glibc), e.g. 65536; default: glibc's own")
    p.add_argument("--buckets", type=int, default=0,
                   help="DeepSpeed's stage3_max_live_parameters, stage3_prefetch_bucket_size and reduce_bucket_size "
                        "(elements) on both sides, e.g. 10000000; default: DeepSpeed's (1e9, 5e7, 5e8)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "zero3_memory")
    p.add_argument("--sides", default="whole,partitioned",
                   help="the sides to run; another side's results are read from --out (an earlier run)")
    p.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both sides")
    args = p.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return 0
    if args.child:
        child(args)
        return 0
    from grpo.foundation.dist import free_port

    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for side in SIDES:
        if side not in args.sides.split(","):  # measured before: its JSON in --out
            results[side] = json.loads((args.out / f"{side}.json").read_text())
            continue
        launcher = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", str(free_port())]
        cmd = launcher + [__file__, "--child", side] + sys.argv[1:]
        if run_side(cmd, side_env(args.threads, args.mmap_threshold)) is None:
            return 1
        results[side] = json.loads((args.out / f"{side}.json").read_text())
        print(f"{side}: {results[side]}", flush=True)
    write_results(args.out, "zero3_memory", results, table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
