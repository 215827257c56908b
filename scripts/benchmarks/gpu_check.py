#!/usr/bin/env python
"""Every GPU measurement of issue 21 in one command, stage by stage.

    python scripts/benchmarks/gpu_check.py --out runs/gpu-check                      # 135M and 1.7B shapes on cuda
    python scripts/benchmarks/gpu_check.py --out runs/gpu-check --shapes 135m         # one shape
    python scripts/benchmarks/gpu_check.py --out /tmp/gc --device cpu --tiny          # the same stages, tiny and fast (tests)

Models have random weights of SmolLM2-135M's or SmolLM2-1.7B's shape, built on the device from the shape
(``--model FOLDER`` measures a real one instead), with a word-level tokenizer of the same vocabulary. Stages,
per shape:

    generation   each engine's completion tokens/s at 64 rows x 256 new tokens (EOS ignored); ``--engines``
                 (default hf,static): hf, static (its mode from rollout.static.mode auto: graphs on
                 CUDA), static:MODE, static:MODE:LENGTH_BUCKET or static:MODE:LENGTH_BUCKET:dynamic
                 (rollout.static.compile_dynamic), generate (transformers' ``model.generate`` on the
                 same left-padded batch: TRL's generation without vLLM, the hf engine's target in issue 41); the static rows add the warm-up seconds
                 (compiles and graph captures at these shapes), their log-prob gap to the trainer, and
                 (eager engines) how many leading greedy tokens of each row equal the first engine's
    stream       streaming rollouts (issue 56): a step at a time against rollout.max_staleness 1 and 2 at the
                 generation stage's shape, EOS at reasoning-like lengths: ms per generated token against EOS ignored,
                 occupancy, tokens per decode step, seconds a step (not in the default stages)
    eos_generation  real lengths (issue 41): each engine (``--engines``) at the generation stage's shape, EOS
                 ignored and then EOS at lengths drawn once from a reasoning-like distribution (recorded: bench.py's
                 reasoning_lengths): decode ms per generated token of both and their ratio, compactions, the
                 static engine's occupancy (``static:graphs@16@4``: continuous batching in 16 slots, read every 4)
    step_256     training steps at 8 prompts x 8 (micro-batches of 16), 256 new tokens (EOS ignored): median time/*
    step_1024    the same at 1024 new tokens        of the steps after the warm-up, peak memory, and the parts of it
                 (weights, master copy, optimizer, gradients, KV cache by arithmetic; activations and the
                 rest = peak - those), step-time outliers (> 1.5x the running median)
    step_256_eos, step_1024_eos  the same with EOS at recorded lengths (reasoning_lengths, seed 0); neither
                 they nor eos_generation are in the default stages
    ref_http     the reference server's HTTP path at 64 x (40 + 256) (scripts/benchmarks/bench_ref_http.py)
    compile_probe  which part of the static decode step torch.compile fails on (sampler, forward, whole step),
                 two layers of the shape (not in the default stages)
    decode_profile each of ``--engines`` (static as eager) under torch.profiler over ``profile_tokens`` new
                 tokens: wall, device and host-sync counts per token, kernels per token, the costliest kernels and
                 host ops; on CUDA the graphs engine's ms per token beside them (not in the default stages)
    train_profile  step_256's log-prob and update phases under torch.profiler, one step after the warm-up: wall,
                 device time, kernels, host syncs, costliest kernels and host ops, MFU per phase (issue 41, item
                 2; not in the default stages)
    real_model   a real model learns (``--real-model``: an HF folder or SmolLM2's .gguf; ``--real-steps``):
                 configs/smollm2_arith.yaml with the reference server as its own process on the same device, EOS
                 active; held-out accuracy before / after, the reward curve, step times (not in the default stages)
    step_rm      step_256 with a learned reward model of the policy's shape (random weights, one logit) as the
                 reward, scored in the trainer process: time/step, reward/rm/latency, reward/model_time_frac
                 (issue 23: the reward model's cost on the step; compare with step_256)

Each stage's JSON is appended to OUT/gpu_check.jsonl as soon as it finishes (a run cut short keeps what it
measured); OUT/gpu_table.md is the table of every stage in that file (earlier runs into OUT included: gpu_session.sh
calls gpu_check once per stage). ``--tiny``: a 2-layer model and small batches.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.benchmarks.bench import forced_eos_processor, reasoning_lengths  # noqa: E402
from scripts.benchmarks.bench_ref import SMOLLM_SHAPE, random_smollm2  # noqa: E402
from scripts.benchmarks import profiling  # noqa: E402
from scripts.benchmarks.profiling import profile_summary  # noqa: E402

SHAPES = {
    "135m": SMOLLM_SHAPE,
    "1.7b": dict(SMOLLM_SHAPE, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=8192, rope_theta=130000.0),
    "tiny": dict(SMOLLM_SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
# (prompts, G, new tokens at the short and the long step, generation rows and tokens, ref rows/prompt/completion)
# micro: rows per forward/backward (64 rows x 1064 tokens at once ran out of an H200's 139 GiB at the 1.7B shape)
# profile_tokens: decode_profile's new tokens (the hf engine at 256 under the profiler outran a 52 s budget on an H100)
FULL = dict(prompts=8, G=8, short=256, long=1024, gen_rows=64, gen_tokens=256, ref=(64, 40, 256), steps=4, warmup=1,
            micro=16, profile_tokens=64)
TINY = dict(prompts=2, G=2, short=8, long=16, gen_rows=4, gen_tokens=8, ref=(4, 6, 8), steps=2, warmup=1, micro=4,
            profile_tokens=8)
PROMPT_WORDS = 40


def record(out: Path, stage: str, shape: str, result: dict) -> dict:
    row = {"stage": stage, "shape": shape, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def _peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak RSS (CPU)


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def write_prompts(path: Path, n: int, vocab: int, words: tuple[int, int] = (PROMPT_WORDS, PROMPT_WORDS)) -> None:
    """``n`` prompts of ``words`` words each (a range: drawn per prompt, seeded; a word is one token)."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(words[0], words[1] + 1, (n,), generator=g).tolist() if words[1] > words[0] else [words[0]] * n
    rows = [{"prompt": " ".join(f"t{int(i)}" for i in torch.randint(4, vocab, (k,), generator=g)), "answer": "x"}
            for k in sizes]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def greedy_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over rows of how many leading tokens two engines' greedy completions share."""
    same = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same.append(n)
    return sum(same) / max(len(same), 1)


def engine_overrides(name: str) -> list[str]:
    """``rollout.*`` overrides of an engine name: ``hf``, ``static``, ``static:MODE``, ``static:MODE:LENGTH_BUCKET`` or
    ``static:MODE:LENGTH_BUCKET:dynamic`` (rollout.static.compile_dynamic) (``auto`` for the trainer's own choice);
    a static engine's name may end in ``@SLOTS`` or ``@SLOTS@CHECK_EVERY`` (continuous batching: rollout.slots,
    rollout.static.check_every)."""
    name, *batching = name.split("@")
    kind, mode, bucket, dynamic = (name.split(":") + ["", "", ""])[:4]
    if dynamic not in ("", "dynamic"):
        raise SystemExit(f"engine {name!r}: its fourth field is 'dynamic' or nothing")
    if len(batching) > 2 or not all(x.isdigit() for x in batching):
        raise SystemExit(f"engine {name!r}: after it, @SLOTS or @SLOTS@CHECK_EVERY (whole numbers)")
    return [f"rollout.engine={kind}", f"rollout.static.mode={mode or 'auto'}",
            f"rollout.static.length_bucket={bucket or 64}",
            f"rollout.static.compile_dynamic={'true' if dynamic else 'false'}",
            *[f"{key}={value}" for key, value in zip(("rollout.slots", "rollout.static.check_every"), batching)]]


def stage_generation(folder: str, device: str, dtype: str, spec: dict, engines: list[str]) -> Iterator[dict]:
    """One result per engine (``hf``, ``static``, ``static:MODE`` or ``static:MODE:LENGTH_BUCKET``) at the same
    prompts and settings, each yielded as soon as it is measured. Engines that return log-probs: their gap to the
    trainer's (``completion_scores``) on the sampled rows. Greedy tokens against the first engine's: eager engines
    only (a compiled engine would compile again for greedy sampling; ``pytest -m gpu`` checks it against eager)."""
    from grpo.foundation.config import ModelConfig
    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.foundation.modeling import load_model
    from grpo.rollout.engine import SamplingParams

    model = load_model(ModelConfig(dtype=dtype), folder).to(device).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, vocab, (PROMPT_WORDS,), generator=g).tolist() for _ in range(spec["gen_rows"] // 8 or 1)]
    n = spec["gen_rows"] // len(prompts)
    params = SamplingParams(max_tokens=spec["gen_tokens"], temperature=1.0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=min(32, spec["gen_tokens"]), ignore_eos=True).greedy()
    reference = None
    for name in engines:
        kind = name.split("@")[0].split(":")[0]
        engine = make_engine(name, model)
        _sync(device)
        t0 = time.perf_counter()  # the warm-up: the measured call's shapes (static: compiles, graph captures)
        engine.generate(prompts, params if kind == "static" else SamplingParams(max_tokens=4, ignore_eos=True), n)
        _sync(device)
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = engine.generate(prompts, params, n)
        _sync(device)
        secs = time.perf_counter() - t0
        tokens = sum(len(t) for t in out.tokens)
        mode = getattr(engine, "mode", None)
        same = None
        if mode in (None, "eager"):
            first = engine.generate(prompts, greedy, 1).tokens
            reference = first if reference is None else reference
            same = greedy_prefix(first, reference)
        gap = {}
        if out.logprobs is not None:
            with torch.no_grad():
                trainer = completion_scores(model, pack([p for p in prompts for _ in range(n)], out.tokens, 0)).logprobs
            d = torch.cat([(torch.tensor(lp) - trainer[i, : len(lp)].float().cpu()).abs()
                           for i, lp in enumerate(out.logprobs)])
            gap = {"logprob_gap_mean": float(d.mean()), "logprob_gap_max": float(d.max())}
        gap.update(audit_kl(engine, model, prompts, params, n))
        floor = bandwidth_floor(model, len(out.tokens), PROMPT_WORDS, spec["gen_tokens"],
                                torch.cuda.get_device_name() if device.startswith("cuda") else "cpu")
        if floor:
            gap.update(floor, share_of_floor=tokens / secs / floor["floor_tokens_per_s"])
        if hasattr(engine, "offload"):
            engine.offload()
        del engine
        yield {"engine": name, "mode": mode, "rows": len(out.tokens),
               "new_tokens": spec["gen_tokens"], "seconds": secs, "tokens_per_s": tokens / secs,
               "warmup_seconds": warm, "greedy_same_tokens": same, "greedy_tokens": greedy.max_tokens, **gap}


# Peak memory bandwidth (bytes/s) of the GPUs these sessions are lent, from their data sheets (docs/gpu.md)
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}


def decode_bytes(model) -> tuple[int, int]:
    """(bytes of the weights, bytes of the KV cache a cached token): what a decode step reads (docs/gpu.md)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return weights, 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def eos_floor(model, lengths: list[int], prompt_tokens: int) -> dict:
    """The bandwidth floor's own cost of real lengths: decode step s reads the weights and the KV cache of the rows
    still running (length > s), prompt + s tokens each, for as many steps as the longest row needs. Bytes a generated
    token with EOS at ``lengths`` over bytes a token with every row run to the longest (EOS ignored): the best
    ratio any engine that decodes the rows together can reach (peak bandwidth cancels)."""
    weights, per_token = decode_bytes(model)
    cap = max(lengths)

    def step_bytes(running: list[int], s: int) -> int:
        return weights + per_token * sum(prompt_tokens + s for length in running if length > s)

    forced = sum(step_bytes(lengths, s) for s in range(cap)) / sum(lengths)
    ignored = sum(step_bytes([cap] * len(lengths), s) for s in range(cap)) / (cap * len(lengths))
    return {"floor_per_token_forced_over_ignored": forced / ignored}


def bandwidth_floor(model, rows: int, prompt_tokens: int, new_tokens: int, device_name: str) -> dict:
    """The decode's bandwidth floor (docs/gpu.md): every decode step reads the weights once and each row's KV cache,
    whose mean length over the decode is prompt + new / 2; tokens/s at the floor = rows x peak bandwidth / those
    bytes. {} where the device's peak bandwidth is not known (the CPU)."""
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in device_name), None)
    if peak is None:
        return {}
    weights, per_token = decode_bytes(model)
    kv = per_token * rows * (prompt_tokens + new_tokens / 2)
    floor = rows * peak / (weights + kv)
    return {"floor_tokens_per_s": floor, "peak_bandwidth": peak, "bytes_per_decode_step": weights + kv}


class TransformersGenerate:
    """``--engines generate``: transformers' ``model.generate`` on the rows left-padded into one batch, sampling as
    TRL's GRPO does without vLLM (do_sample, top-k off unless set; EOS ignored through ``min_new_tokens``, forced
    lengths through a logits processor, as bench.py's TRL side). The baseline of the hf engine's target."""

    mode = None

    def __init__(self, model, pad_id: int = 0, eos_id: int = 2):
        self.model, self.pad_id, self.eos_id = model, pad_id, eos_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params, n: int):
        from types import SimpleNamespace

        from transformers import LogitsProcessorList

        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kw = {"max_new_tokens": params.max_tokens, "pad_token_id": self.pad_id, "eos_token_id": self.eos_id}
        if params.top_k == 1:
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if params.ignore_eos:
            kw["min_new_tokens"] = params.max_tokens
        if params.forced_eos_lengths:
            kw["logits_processor"] = LogitsProcessorList([forced_eos_processor(width, list(params.forced_eos_lengths),
                                                                               self.eos_id)])
        rows = self.model.generate(input_ids=ids.repeat_interleave(n, 0), attention_mask=att.repeat_interleave(n, 0),
                                   **kw)[:, width:].tolist()
        tokens = [r if params.ignore_eos or self.eos_id not in r else r[: r.index(self.eos_id) + 1] for r in rows]
        return SimpleNamespace(tokens=tokens, logprobs=None, topk_logprobs=None)


def make_engine(name: str, model):
    """An engine of ``--engines`` over ``model`` (``generate``: transformers' own, ``TransformersGenerate``)."""
    from grpo.rollout.engine import EngineSetup
    from grpo.rollout.service import engine_class
    from grpo.training.configure import load_config

    if name == "generate":
        return TransformersGenerate(model)
    cfg = load_config(None, "grpo", engine_overrides(name))
    return engine_class(name.split("@")[0].split(":")[0])(EngineSetup(cfg=cfg, model=model, tokenizer=None, eos_ids=[2], pad_id=0))


def audit_kl(engine, model, prompts: list[list[int]], params, n: int, k: int = 8) -> dict:
    """The audit's figure for this engine (issue 45): KL(pi_sampler || pi_trainer) over the engine's top-k of each
    drawn token's distribution plus the rest (rl_math.topk_divergence), against the training forward on the same
    weights; mean and max over the positions. {} for an engine without top-k."""
    import dataclasses

    from grpo.foundation import rl_math
    from grpo.foundation.logprobs import completion_scores, pack

    out = engine.generate(prompts, dataclasses.replace(params, topk_logprobs=k), n)
    if out.topk_logprobs is None:
        return {}
    packed = pack([p for p in prompts for _ in range(n)], out.tokens, 0)
    width = packed.width
    with torch.no_grad():
        trainer = completion_scores(model, packed, params.temperature, gather_ids=out.topk_ids[:, :width]).gathered
    kl = rl_math.topk_divergence(trainer.double().cpu(), out.topk_logprobs[:, :width].double(), 0.0)
    valid = packed.attention_mask.new_zeros(kl.shape, dtype=torch.bool)
    for i, t in enumerate(out.tokens):
        valid[i, : len(t)] = True
    return {"audit_kl_mean": float(kl[valid].mean()), "audit_kl_max": float(kl[valid].max()), "audit_top_k": k}


def stage_stream(folder: str, device: str, dtype: str, spec: dict) -> dict:
    """Streaming rollouts (issue 56) at the generation stage's shape: ``gen_rows`` rows a step (8 a group), EOS at
    reasoning-like recorded lengths, a step at a time against rollout.max_staleness 1 and 2 over 64 slots
    (scripts/benchmarks/bench_stream.py's measure, the static engine in its default mode: graphs on CUDA), beside
    the EOS-ignored figure of the same engine: ms per generated token of each, occupancy, tokens per decode step."""
    from grpo.foundation.config import ModelConfig
    from grpo.foundation.modeling import load_model
    from grpo.rollout.engine import SamplingParams
    from scripts.benchmarks.bench_stream import engine_for, measure

    model = load_model(ModelConfig(dtype=dtype), folder).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, model.config.vocab_size, (PROMPT_WORDS,), generator=g).tolist() for _ in range(64)]
    groups, G = max(1, spec["gen_rows"] // 8), min(8, spec["gen_rows"])
    engine = engine_for(model, 2)
    free = SamplingParams(max_tokens=spec["gen_tokens"], temperature=1.0, ignore_eos=True)
    engine.generate(prompts[:groups], free, G)  # the warm-up: compiles, captures
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts[:groups], free, G)
    _sync(device)
    ignored = 1000 * (time.perf_counter() - t0) / sum(len(t) for t in out.tokens)
    del engine
    res = measure(model, 2, prompts, groups, G, spec["gen_tokens"], steps=3, runs=[(1, 64, 4), (2, 64, 4)],
                  sync=lambda: _sync(device))
    for side in [k for k in res if isinstance(res[k], dict) and "seconds" in res[k]]:
        r = res[side]
        r["ms_per_token"] = 1000 * r["seconds"] / max(1.0, r["decoded_tokens"])
        r["per_token_over_ignored"] = r["ms_per_token"] / ignored
    return {"ignored_ms_per_token": ignored, **res}


def stage_eos_generation(folder: str, device: str, dtype: str, spec: dict, engines: list[str]) -> Iterator[dict]:
    """Real lengths (issue 41, item 4): per engine, ``gen_rows`` rows of up to ``gen_tokens`` tokens, EOS ignored and
    then EOS forced at lengths drawn once from a reasoning-like distribution (scripts/benchmarks/bench.py:
    reasoning_lengths, recorded here). Decode time per generated token with EOS against without (the target: within
    1.2x): what finished rows cost, compaction included; beside it the ratio the bandwidth floor itself allows
    for these lengths (eos_floor)."""
    from grpo.foundation.config import ModelConfig
    from grpo.foundation.modeling import load_model
    from grpo.rollout.engine import SamplingParams

    model = load_model(ModelConfig(dtype=dtype), folder).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, model.config.vocab_size, (PROMPT_WORDS,), generator=g).tolist()
               for _ in range(spec["gen_rows"] // 8 or 1)]
    n = spec["gen_rows"] // len(prompts)
    drawn = reasoning_lengths(len(prompts) * n, spec["gen_tokens"], seed=0)
    free = SamplingParams(max_tokens=spec["gen_tokens"], temperature=1.0, ignore_eos=True)
    forced = SamplingParams(max_tokens=spec["gen_tokens"], temperature=1.0, forced_eos_lengths=tuple(drawn["lengths"]))
    for name in engines:
        engine = make_engine(name, model)
        res = {"engine": name, "mode": getattr(engine, "mode", None), "rows": len(prompts) * n,
               "new_tokens": spec["gen_tokens"], "eos_distribution": drawn}
        for label, params in (("ignored", free), ("forced", forced)):
            engine.generate(prompts, params, n)  # the warm-up: this call's shapes (static: compiles, captures)
            if hasattr(engine, "pop_metrics"):
                engine.pop_metrics()
            _sync(device)
            t0 = time.perf_counter()
            out = engine.generate(prompts, params, n)
            _sync(device)
            secs = time.perf_counter() - t0
            tokens = sum(len(t) for t in out.tokens)
            res[label] = {"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs,
                          "ms_per_token": 1000 * secs / tokens,
                          **(engine.pop_metrics() if hasattr(engine, "pop_metrics") else {})}
        res["per_token_forced_over_ignored"] = res["forced"]["ms_per_token"] / res["ignored"]["ms_per_token"]
        res.update(eos_floor(model, drawn["lengths"], PROMPT_WORDS))
        if hasattr(engine, "offload"):
            engine.offload()
        del engine
        yield res


def stage_real_model(model: str, device: str, dtype: str, spec: dict, out: Path, steps: int, tiny: bool) -> dict:
    """A real model learns (issue 41, item 5): ``model`` (an HF folder, or a GGUF file converted here first, as
    scripts/fetch_smollm2.py does) on configs/smollm2_arith.yaml, EOS active, with the reference server as its own
    process on the same device (scripts/benchmarks/learn_smollm2.py's train_with_reference), for ``steps`` steps:
    held-out greedy accuracy before and after, the fixed / broken problems, the reward curve, the step times.
    ``tiny``: a few steps of a small task (the stage end to end on CPU)."""
    import os

    from scripts.benchmarks import learn_smollm2 as learn

    folder = Path(model)
    if folder.suffix == ".gguf":
        sys.path.insert(0, str(ROOT / "scripts"))
        from fetch_smollm2 import convert, is_complete

        folder = out / "real-model"
        if not is_complete(folder):
            convert(Path(model), folder)
    run_dir = out / "real"
    overrides = [f"model.name_or_path={folder}", f"model.dtype={dtype}", f"train.max_steps={steps}",
                 f"eval.every={max(1, steps // 4)}", "train.save_every=0", "logging.log_every=1"]
    if device.startswith("cuda"):
        overrides += ["model.freeze_bottom_layers=0", "eval.batch_size=200"]  # the whole model trains on a GPU
    if tiny:
        overrides += ["data.chat_template=false", "data.arithmetic.num_examples=80", "data.eval_holdout=8",
                      "eval.batch_size=8", "rollout.prompts_per_step=2", "rollout.num_generations=2",
                      "rollout.max_completion_length=6", "rollout.max_prompt_length=256", "train.micro_batch_size=4", "model.freeze_bottom_layers=0"]
    threads = max(1, (os.cpu_count() or 2) // 2)
    t0 = time.perf_counter()
    walls = learn.train_with_reference([0], "configs/smollm2_arith.yaml", run_dir, threads, overrides)
    summary = learn.summarize(run_dir / "seed-0")
    rows = [json.loads(line) for line in (run_dir / "seed-0" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_s = [r["time/step"] for r in rows if "time/step" in r]
    return {"model": str(model), "steps": summary["steps"], "held_out": summary["n"],
            "accuracy_before": summary["before"], "accuracy_after": summary["after"],
            "accuracy_gain": summary["after"] - summary["before"], "fixed": summary["fixed"],
            "broken": summary["broken"], "sign_test_p": summary["p"], "evals": summary["evals"],
            "rewards": summary["rewards"], "kl_last": summary["kl_last"], "reference_share": summary["ref_share"],
            "step_median_s": statistics.median(step_s) if step_s else None, "train_wall_s": walls[0],
            "stage_wall_s": time.perf_counter() - t0, "overrides": overrides, "run": str(run_dir / "seed-0")}


def memory_parts(n_params: int, shape: dict, dtype: str, states: str, rows: int, tokens: int) -> dict:
    """Bytes of each part that arithmetic gives: weights, fp32 master copy, Adam moments, gradients, KV cache."""
    w = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    mixed = dtype != "fp32" and states == "fp32"  # DeepSpeed's bf16 mode: fp32 master, moments and gradients
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * rows * tokens * w
    return {"weights": n_params * w, "master": n_params * 4 if mixed else 0,
            "optimizer": n_params * (8 if (mixed or dtype == "fp32") else 2 * w),
            "gradients": n_params * (4 if mixed else w), "kv_cache": kv}


def step_config(folder: str, dtype: str, spec: dict, new_tokens: int, out: Path, states: str, engine: str = "auto",
                rewards: str = "[{fn: 'scripts.benchmarks.bench:bench_reward'}]", overrides: tuple[str, ...] = (),
                eos_lengths: Optional[dict] = None):
    """The step stages' trainer config: GRPO (beta 0.04, an in-process reference) on ``spec``'s batch of 40-word
    prompts, ``new_tokens`` new tokens (EOS ignored, or rows ending at ``eos_lengths``), a word-count reward."""
    from grpo.training.configure import load_config

    data = out / "prompts.jsonl"
    write_prompts(data, spec["prompts"] * (spec["steps"] + spec["warmup"] + 1), 64, spec["prompt_words"])
    return load_config(None, "grpo", [
        f"model.name_or_path={folder}", f"model.dtype={dtype}", "model.gradient_checkpointing=false",
        "data.source=jsonl", f"data.path={data}", "data.shuffle=false",
        f"rollout.num_generations={spec['G']}", f"rollout.prompts_per_step={spec['prompts']}",
        f"rollout.max_completion_length={new_tokens}", "rollout.max_prompt_length=512",
        *(["rollout.ignore_eos=true"] if eos_lengths is None else [f"rollout.forced_eos_lengths={eos_lengths['lengths']}"]),
        f"train.max_steps={spec['steps'] + spec['warmup']}", "train.lr=1e-6", f"train.optimizer_states={states}",
        f"train.micro_batch_size={spec['micro']}", f"train.output_dir={out / 'run'}",
        "logging.progress_bar=false", "logging.plot=false", f"rewards={rewards}",
        "algo.beta=0.04", "reward_pool.num_workers=0",  # the reward is a word count: no worker processes
        *engine_overrides(engine), *overrides,
    ])


def stage_step(folder: str, device: str, dtype: str, spec: dict, new_tokens: int, out: Path, states: str,
               engine: str = "auto", rewards: str = "[{fn: 'scripts.benchmarks.bench:bench_reward'}]",
               overrides: tuple[str, ...] = (), eos_lengths: Optional[dict] = None) -> dict:
    """Training steps; ``eos_lengths`` (reasoning_lengths' record): rows end at those lengths instead of running to
    ``new_tokens`` with EOS ignored."""
    from grpo.training.trainer import Trainer

    cfg = step_config(folder, dtype, spec, new_tokens, out, states, engine, rewards, overrides, eos_lengths)
    _reset_peak(device)
    trainer = Trainer(cfg)
    steps = []
    try:
        for i in range(spec["steps"] + spec["warmup"]):
            m = trainer.train_step()
            trainer.step += 1
            trainer.step_watch.check(trainer.step, m)
            steps.append({k: v for k, v in m.items() if k.startswith(("time/", "memory/", "audit/", "rollout_corr/"))
                          or k.endswith(("/latency", "_frac")) and k.startswith("reward/")})
        peak = max(_peak_bytes(device), trainer.memory.run_peak)  # the trainer resets the counter at each phase
        n_params = sum(p.numel() for p in trainer.model.parameters())
        shape = trainer.model.config.to_dict()
    finally:
        trainer.close()
    kept = steps[spec["warmup"]:]
    med = {k: statistics.median(s.get(k, 0.0) for s in kept) for k in kept[0]}
    rows = spec["prompts"] * spec["G"]
    parts = memory_parts(n_params, shape, dtype, states, rows, PROMPT_WORDS + new_tokens)
    parts["reference"] = n_params * {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]  # the in-process reference (beta > 0)
    phases = {k: max(st.get(k, 0.0) for st in steps)
              for k in {k for st in steps for k in st if k.startswith("memory/") and k.endswith("_gib")}}
    kv_held = not phases or max(phases, key=phases.get) == "memory/generate_gib"
    kv = parts["kv_cache"] if kv_held else parts.pop("kv_cache")  # freed before the passes that set the peak
    parts["activations_and_rest"] = peak - sum(parts.values())
    return {"new_tokens": new_tokens, "rows": rows, "prompt_words": list(spec["prompt_words"]),
            "micro_batch": spec["micro"], "engine": f"{type(trainer.rollout.engine).__name__} "
            f"{getattr(trainer.rollout.engine, 'mode', '')}".strip(),
            "optimizer_states": states, "params": n_params, "overrides": list(overrides),
            **({"eos_distribution": eos_lengths} if eos_lengths else {}),
            "median": med, "steps": steps, "peak_bytes": peak, "peak_kind": "cuda allocated" if device.startswith(
                "cuda") else "process RSS", "memory_parts": parts, "kv_cache_bytes": kv, "kv_cache_in_peak": kv_held,
            "phase_peaks": phases,
            "outliers": [list(o) for o in trainer.step_watch.outliers if o[0] > spec["warmup"]],
            "max_over_median": max(s["time/step"] for s in kept) / max(med["time/step"], 1e-12)}


# Dense bf16 tensor-core peak (FLOP/s) of the GPUs these sessions are lent, from their data sheets (for MFU)
PEAK_BF16 = {"H200": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100": 989e12}


def stage_train_profile(folder: str, device: str, dtype: str, spec: dict, out: Path, states: str,
                        engine: str = "auto", overrides: tuple[str, ...] = ()) -> dict:
    """Where the training passes' time goes (issue 41, item 2): step_256's trainer runs ``warmup`` + 1 steps, then
    one more whose phases run one by one as ``Trainer.train_step`` runs them, the log-prob phase (the reference's
    log-probs and, where the algorithm needs them, the old policy's) and the update phase (forward and backward of
    every micro-batch, the optimizer, the weight sync) each under torch.profiler: wall, device time, kernels, host
    syncs, the costliest kernels and host ops (profile_summary), and the phase's MFU: model FLOPs (2 N a token a
    forward, 6 N forward + backward, N the parameters; attention left out) over wall time x the GPU's dense bf16
    peak (PEAK_BF16). ``unprofiled``: the last unprofiled step's phase times, to show the profiler's overhead."""
    from grpo.training.trainer import Trainer

    cuda = device.startswith("cuda")
    cfg = step_config(folder, dtype, spec, spec["short"], out, states, engine, overrides=overrides)
    trainer = Trainer(cfg)
    try:
        for _ in range(spec["warmup"] + 1):
            m = trainer.train_step()
            trainer.step += 1
        unprofiled = {k: v for k, v in m.items() if k.startswith("time/")}
        step = trainer.rollout_phase()
        rows = len(step.batch.prompt_ids)
        tokens = sum(len(p) for p in step.batch.prompt_ids) + int(step.batch.mask.sum())
        n_params = sum(p.numel() for p in trainer.model.parameters())
        forwards = (trainer.algo.needs_reference + (trainer.algo.needs_old_logprobs or trainer.algo.needs_entropy))
        flops = {"logprobs": 2 * n_params * tokens * forwards,
                 "update": 6 * n_params * tokens * cfg.algo.num_iterations}
        name = torch.cuda.get_device_name() if cuda else ""
        peak = next((f for k, f in PEAK_BF16.items() if k in name), None)
        phases = {}
        for label, run in (("logprobs", trainer.logprob_phase), ("advantages", trainer.advantage_phase),
                           ("update", trainer.update_phase)):
            _sync(device)
            prof = profiling.start(cuda)
            run(step)
            phases[label] = profiling.finish(prof, cuda)
            if label in flops:
                phases[label]["model_tflop"] = flops[label] / 1e12
                phases[label]["mfu"] = flops[label] / (phases[label]["wall_ms"] / 1000) / peak if peak else None
        trainer.metrics_phase(step)
    finally:
        trainer.close()
    return {"rows": rows, "tokens": tokens, "params": n_params, "micro_batch": spec["micro"],
            "optimizer_states": states, "overrides": list(overrides), "peak_bf16_flops": peak,
            "unprofiled": unprofiled, "phases": phases}


def stage_ref_http(folder: str, device: str, dtype: str, spec: dict) -> dict:
    from scripts.benchmarks.bench_ref_http import run

    rows, prompt, completion = spec["ref"]
    return run(folder, rows, prompt, completion, requests=10 if rows > 8 else 3,
               extra_server_args=("--device", device, "--dtype", dtype))


def _engine(folder: str, device: str, dtype: str, mode: str):
    """(model, a static engine in ``mode``) over a fresh load of ``folder``."""
    from grpo.foundation.config import ModelConfig
    from grpo.foundation.modeling import load_model

    model = load_model(ModelConfig(dtype=dtype), folder).to(device).eval()
    return model, make_engine(f"static:{mode}", model)


def stage_compile_probe(folder: str, device: str, dtype: str, spec: dict) -> dict:
    """Which part of the static engine's decode step torch.compile (Inductor) fails on, at this shape with two
    layers: the sampler alone, the forward alone, the whole step. Each part: "ok" and its seconds, or the error's
    last line."""
    from grpo.rollout import static

    model, engine = _engine(folder, device, dtype, "eager")
    w = engine.weights()
    w.layers = w.layers[:2]
    s = static.model_spec(model)
    rows, vocab = spec["gen_rows"], model.config.vocab_size
    k = torch.zeros((2, rows, s.kv_heads, 64, s.head_dim), dtype=w.embed.dtype, device=device)
    v, kpos = torch.zeros_like(k), torch.full((rows, 64), -1, dtype=torch.long, device=device)
    tok = torch.randint(4, vocab, (rows,), device=device)
    pos, col = torch.full((rows,), 5, device=device), torch.tensor([5], device=device)
    u, logits = torch.rand(rows, device=device), torch.randn(rows, vocab, device=device)
    sampling = (1.0, 1.0, 0)
    parts = {
        "sample": (static.sample, (logits, u, *sampling)),
        "forward": (lambda flat, *a: static.forward(s, static.Weights.unflat(flat, w.rope_scale), *a),
                    (w.flat(), tok[:, None], pos[:, None], col, k, v, kpos, 64)),
        "step": (lambda flat, *a: engine._step(flat, *a), (w.flat(), tok, pos, col, u, k, v, kpos, 64, w.rope_scale,
                                                           sampling)),
    }
    out = {"torch": torch.__version__, "layers": 2, "rows": rows}
    for name, (fn, args) in parts.items():
        torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            torch.compile(fn, dynamic=False)(*args)
            _sync(device)
            out[name] = f"ok in {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # the point of the stage: which part fails, and how
            out[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
    engine = model = None  # (not del: the parts' lambdas name the engine)
    return out


def stage_decode_profile(folder: str, device: str, dtype: str, spec: dict, engines: list[str]) -> dict:
    """Where a decode step's time goes, per engine of ``engines`` (a static one runs eager; hf and generate as they
    are), ``profile_tokens`` tokens at ``gen_rows`` rows under torch.profiler: wall, kernels and device ms per token, ops
    that make the host wait per token (and, on CUDA, the runtime's synchronize calls), the 12 costliest kernels
    (device time; CPU ops on CPU) and the 8 costliest host ops (self CPU time: where a launch-bound engine's time
    goes). On CUDA with a static engine also the graphs engine's wall ms per token (launches cost nothing there)."""
    from torch.profiler import ProfilerActivity, profile

    from grpo.foundation.config import ModelConfig
    from grpo.foundation.modeling import load_model
    from grpo.rollout.engine import SamplingParams

    cuda = device.startswith("cuda")
    g = torch.Generator().manual_seed(1)
    n = 8 if spec["gen_rows"] >= 8 else 2
    prompts = [torch.randint(4, 512, (PROMPT_WORDS,), generator=g).tolist() for _ in range(spec["gen_rows"] // n)]
    params = SamplingParams(max_tokens=spec["profile_tokens"], temperature=1.0, ignore_eos=True)
    T = params.max_tokens
    out = {"rows": len(prompts) * n, "new_tokens": T, "engines": {}}
    names = ["static:eager" if e.split(":")[0] == "static" else e for e in engines]
    if cuda and "static:eager" in names:
        names.append("static:graphs")
    for name in dict.fromkeys(names):
        model = load_model(ModelConfig(dtype=dtype), folder).to(device).eval()
        engine = make_engine(name, model)
        engine.generate(prompts, params, n)  # warm-up (graph captures)
        _sync(device)
        if name == "static:graphs":
            t0 = time.perf_counter()
            engine.generate(prompts, params, n)
            _sync(device)
            out["graphs_ms_per_token"] = 1000 * (time.perf_counter() - t0) / T
        else:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                engine.generate(prompts, params, n)
                _sync(device)
            out["engines"][name] = {"wall_ms_per_token": 1000 * (time.perf_counter() - t0) / T,
                                    **profile_summary(prof, cuda, T, "_per_token")}
        del engine, model
        if cuda:
            torch.cuda.empty_cache()
    return out


def earlier_rows(out: Path) -> list[dict]:
    """The stages an earlier run recorded in ``out`` (gpu_session.sh calls gpu_check once per stage into one folder):
    gpu_table.md shows them with this run's, as gpu_check.jsonl holds them."""
    path = out / "gpu_check.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("stage") != "machine"]


def table(rows: list[dict]) -> str:
    lines = ["| shape | stage | result |", "|---|---|---|"]
    for r in rows:
        try:
            res = row_text(r)
        except KeyError:  # a row of an older gpu_check in the same folder: its fields as they are
            res = fields(r)
        lines.append(f"| {r['shape']} | {r['stage']} | {res} |")
    return "\n".join(lines) + "\n"


def row_text(r: dict) -> str:
    """One stage's result, in words."""
    if r["stage"] == "generation":
        res = f"{r['tokens_per_s']:.0f} tokens/s ({r['engine']}, {r['rows']} rows x {r['new_tokens']})"
        if "floor_tokens_per_s" in r:
            res += f", {r['share_of_floor']:.0%} of the bandwidth floor {r['floor_tokens_per_s']:.0f} tokens/s"
        if r["mode"] is not None:
            res += f"; warm-up {r['warmup_seconds']:.1f} s, mode {r['mode']}"
        if r["greedy_same_tokens"] is not None:
            res += (f", {r['greedy_same_tokens']:.1f} of {r['greedy_tokens']} greedy tokens equal the first "
                    f"engine's")
        if "logprob_gap_mean" in r:
            res += f", log-prob gap to the trainer {r['logprob_gap_mean']:.2g} mean, {r['logprob_gap_max']:.2g} max"
    elif r["stage"] == "stream":
        sides = {k: v for k, v in r.items() if isinstance(v, dict) and "occupancy" in v}
        res = f"EOS ignored {r['ignored_ms_per_token']:.3f} ms a token; " + "; ".join(
            f"{k}: {v['ms_per_token']:.3f} ms a token ({v['per_token_over_ignored']:.2f}x), occupancy "
            f"{v['occupancy']:.0%}, {v['tokens_per_decode_step']:.1f} tokens a decode step, "
            f"{v['seconds'] / r['steps']:.2f} s a step" for k, v in sides.items())
    elif r["stage"] == "eos_generation":
        d, a, b = r["eos_distribution"], r["ignored"], r["forced"]
        res = (f"{r['engine']} ({r['mode']}), {r['rows']} rows x up to {r['new_tokens']}: EOS ignored "
               f"{a['ms_per_token']:.3f} ms a token ({a['tokens_per_s']:.0f} tokens/s), EOS at recorded lengths "
               f"(mean {d['mean']:.0f}, median {d['p50']}, p90 {d['p90']}, {d['share_at_cap']:.0%} at the cap) "
               f"{b['ms_per_token']:.3f} ms a token ({b['tokens_per_s']:.0f} tokens/s, "
               f"{b.get('rollout/compactions', 0):.0f} compactions, occupancy {b.get('rollout/occupancy', 0):.0%} "
               f"over {b.get('rollout/decode_steps', 0):.0f} decode steps, "
               f"{(b['tokens'] - r['rows']) / max(1, b.get('rollout/decode_steps', 0)):.1f} tokens a step): "
               f"{r['per_token_forced_over_ignored']:.2f}x "
               f"(the bandwidth floor's own: {r['floor_per_token_forced_over_ignored']:.2f}x)")
    elif r["stage"].startswith("step"):
        md, parts = r["median"], r["memory_parts"]
        res = (f"{md['time/step']:.2f} s/step ({r['engine']}; generation {md.get('time/generation', 0):.2f}, "
               f"reference "
               f"{md.get('time/reference', 0):.2f}, train {md.get('time/train', 0):.2f}, sync "
               f"{md.get('time/weight_sync', 0):.2f}); peak {r['peak_bytes'] / 2**30:.2f} GiB ({r['peak_kind']}: "
               + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in parts.items())
               + ("" if r.get("kv_cache_in_peak", True) else
                  f"; the KV cache, {r['kv_cache_bytes'] / 2**30:.2f}, was freed before the passes that set it")
               + f"); slowest step {r['max_over_median']:.2f}x the median, {len(r['outliers'])} outliers")
        phases = r.get("phase_peaks") or {}
        if phases:  # CUDA: which phase of a step sets the peak (the most over the steps)
            res += "; phase peaks " + ", ".join(f"{k[7:-4]} {v:.2f}" for k, v in sorted(phases.items())) + " GiB"
        if r.get("overrides"):
            res += "; " + " ".join(r["overrides"])
        if r.get("eos_distribution"):
            d = r["eos_distribution"]
            res += f"; EOS at recorded lengths (mean {d['mean']:.0f}, p90 {d['p90']}, {d['share_at_cap']:.0%} at the cap)"
        if "time/audit" in md:  # issue 45: the audit's share of a step
            res += f"; audit {md['time/audit']:.3f} s a step, {md['time/audit'] / md['time/step']:.1%} of it"
        if "reward/rm/latency" in md:
            res += (f"; reward model {md['reward/rm/latency']:.3f} s a step, "
                    f"{md.get('reward/model_time_frac', 0):.2f} of the step")
    elif r["stage"] == "real_model":
        res = (f"{Path(r['model']).name}: held-out accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} "
               f"({r['held_out']} problems, {r['fixed']} fixed / {r['broken']} broken) in {r['steps']} steps, "
               f"{r['train_wall_s']:.0f} s of training, {r['step_median_s']:.2f} s a step (median)")
    elif r["stage"] == "ref_http":
        res = (f"HTTP path {r['http_path_ms']:.1f} ms (p90 {r['http_path_p90_ms']:.1f}; server parse "
               f"{r['server_parse_ms']:.1f}, wait {r['server_wait_ms']:.1f}, client codec {r['client_codec_ms']:.1f}, "
               f"rest {r['rest_ms']:.1f}) against a {r['server_forward_ms']:.1f} ms forward, {r['rows']} x "
               f"({r['prompt']} + {r['completion']})")
    elif r["stage"] == "decode_profile":
        res = f"{r['rows']} rows: " + "; ".join(
            f"{name} {e['wall_ms_per_token']:.2f} ms a token ({e['kernels_per_token']:.0f} kernels, "
            f"{e['device_ms_per_token']:.2f} ms of device time, {e['sync_ops_per_token']:.2f} host syncs; "
            f"costliest kernels " + ", ".join(f"{t['name'][:40]} {t['ms_per_token']:.3f}" for t in e["top"][:3])
            + "; costliest host ops " + ", ".join(f"{t['name'][:40]} {t['ms_per_token']:.3f}"
                                                  for t in e["host_top"][:3]) + ")"
            for name, e in r["engines"].items())
        if "graphs_ms_per_token" in r:
            res += f"; static:graphs {r['graphs_ms_per_token']:.2f} ms a token"
    elif r["stage"] == "train_profile":
        res = f"{r['rows']} rows, {r['tokens']} tokens: " + "; ".join(
            f"{name} {ph['wall_ms']:.0f} ms ({ph['device_ms']:.0f} ms of device time, {ph['kernels']:.0f} kernels, "
            f"{ph['sync_ops']:.0f} host syncs" + (f", MFU {ph['mfu']:.0%}" if ph.get("mfu") is not None else "")
            + "; costliest kernels " + ", ".join(f"{t['name'][:40]} {t['ms']:.1f}" for t in ph["top"][:3]) + ")"
            for name, ph in r["phases"].items())
    else:
        res = fields(r)
    return res


def fields(r: dict) -> str:
    """A row's result fields as JSON (a stage the table does not word)."""
    return json.dumps({k: v for k, v in r.items() if k not in ("stage", "shape", "time")})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder: gpu_check.jsonl (appended stage by stage), gpu_table.md")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small batches (a quick check of the stages)")
    p.add_argument("--shapes", default="135m,1.7b", help="comma-separated: 135m, 1.7b")
    p.add_argument("--model", help="an HF folder to measure instead of random shapes")
    p.add_argument("--optimizer-states", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--stages", default="generation,step_256,step_1024,ref_http,step_rm")
    p.add_argument("--engines", default="hf,static",
                   help="the generation stage's engines, comma-separated: hf, generate (transformers' own), "
                        "static, static:MODE, static:MODE:LENGTH_BUCKET or static:MODE:LENGTH_BUCKET:dynamic "
                        "(MODE: auto, eager, compile, graphs, compile+graphs; LENGTH_BUCKET: "
                        "rollout.static.length_bucket, 0 = whole buffer; dynamic: rollout.static.compile_dynamic); "
                        "greedy tokens compare with the first")
    p.add_argument("--step-engine", default="auto",
                   help="the step stages' engine, named as in --engines (default auto: the trainer's own choice)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the step stages (repeatable), e.g. train.logprob_chunk_size=512")
    p.add_argument("--steps", type=int, help="measured steps of the step stages (default 4; more to look for outliers)")
    p.add_argument("--prompt-words", default=str(PROMPT_WORDS), metavar="N or A-B",
                   help="the step stages' prompt lengths in words (one token each): N, or A-B drawn per prompt "
                        "(seeded), so that every step's batch has new widths, as real data has")
    p.add_argument("--real-model", help="the real_model stage's model: an HF folder or a .gguf file (converted first)")
    p.add_argument("--real-steps", type=int, default=60, help="training steps of the real_model stage")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(TINY if args.tiny else FULL)
    if args.steps:
        spec["steps"] = args.steps
    lo, _, hi = args.prompt_words.partition("-")
    try:
        spec["prompt_words"] = (int(lo), int(hi or lo))
    except ValueError:
        raise SystemExit(f"--prompt-words {args.prompt_words!r}: give N or A-B (whole numbers of words)") from None
    if not 1 <= spec["prompt_words"][0] <= spec["prompt_words"][1]:
        raise SystemExit(f"--prompt-words {args.prompt_words!r}: need 1 <= A <= B")
    dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    states = args.optimizer_states if dtype == "bf16" else "fp32"
    stages = args.stages.split(",")
    if args.device == "cpu":
        import os
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer and the server pick their device themselves
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    from grpo.foundation import dist

    # the trainer's host threads (one on CUDA) for every stage, the engines' too: until 2026-11-27 the generation
    # stages ran with torch's default (a thread a core) and the step stages with the trainer's
    threads = dist.host_threads(args.device.startswith("cuda"))
    rows = earlier_rows(out)
    record(out, "machine", "-", {"device": args.device, "name": gpu, "commit": commit, "torch": torch.__version__,
                                 "dtype": dtype, "optimizer_states": states, "tiny": args.tiny, "host_threads": threads})
    shapes = [("model", args.model)] if args.model else [(s, None) for s in (["tiny"] if args.tiny else args.shapes.split(","))]
    for name, folder in shapes:
        if folder is None:
            folder = str(out / f"random-{name}")
            if not (Path(folder) / "config.json").exists():
                random_smollm2(Path(folder), SHAPES[name], args.device,
                               torch.bfloat16 if dtype == "bf16" else torch.float32)
        for stage in stages:
            t0 = time.perf_counter()
            if stage == "generation":
                for res in stage_generation(folder, args.device, dtype, spec, args.engines.split(",")):
                    rows.append(record(out, stage, name, res))
                    (out / "gpu_table.md").write_text(table(rows))
                continue
            elif stage == "stream":
                res = stage_stream(folder, args.device, dtype, spec)
            elif stage == "eos_generation":
                for res in stage_eos_generation(folder, args.device, dtype, spec, args.engines.split(",")):
                    rows.append(record(out, stage, name, res))
                    (out / "gpu_table.md").write_text(table(rows))
                continue
            elif stage in ("step_256", "step_1024", "step_256_eos", "step_1024_eos"):
                tokens = spec["short" if stage.startswith("step_256") else "long"]
                eos = reasoning_lengths(spec["prompts"] * spec["G"], tokens, seed=0) if stage.endswith("_eos") else None
                res = stage_step(folder, args.device, dtype, spec, tokens, out, states, args.step_engine,
                                 overrides=tuple(args.set), eos_lengths=eos)
            elif stage == "ref_http":
                res = stage_ref_http(folder, args.device, dtype, spec)
            elif stage == "real_model":
                if not args.real_model:
                    raise SystemExit("the real_model stage needs --real-model (an HF folder or a .gguf file)")
                res = stage_real_model(args.real_model, args.device, dtype, spec, out, args.real_steps, args.tiny)
            elif stage == "compile_probe":
                res = stage_compile_probe(folder, args.device, dtype, spec)
            elif stage == "decode_profile":
                res = stage_decode_profile(folder, args.device, dtype, spec, args.engines.split(","))
            elif stage == "train_profile":
                res = stage_train_profile(folder, args.device, dtype, spec, out, states, args.step_engine,
                                          overrides=tuple(args.set))
            elif stage == "step_rm":
                rm = out / f"random-{name}-rm"
                if not (rm / "config.json").exists():
                    conf = json.loads((Path(folder) / "config.json").read_text())  # the policy's shape
                    random_smollm2(rm, {k: conf.get(k, v) for k, v in SHAPES["135m"].items()}, args.device,
                                   torch.bfloat16 if dtype == "bf16" else torch.float32, classifier=True)
                res = stage_step(folder, args.device, dtype, spec, spec["short"], out, states, args.step_engine,
                                 rewards=f"[{{model: '{rm}', name: rm}}, {{fn: 'scripts.benchmarks.bench:bench_reward', "
                                         f"weight: 0}}]", overrides=tuple(args.set))
                res["reward_model"] = str(rm)
            else:
                raise SystemExit(f"unknown stage {stage!r}; valid: generation, eos_generation, stream, step_256, step_1024, "
                                 f"step_256_eos, step_1024_eos, ref_http, step_rm, real_model, compile_probe, "
                                 f"decode_profile, train_profile")
            res["stage_seconds"] = time.perf_counter() - t0
            rows.append(record(out, stage, name, res))
            (out / "gpu_table.md").write_text(table(rows))
    print(f"\n{out / 'gpu_table.md'}:\n\n{table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
