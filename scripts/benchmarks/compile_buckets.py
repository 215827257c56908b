#!/usr/bin/env python
"""How many graphs the static engine's compiled decode step compiles, and how long its first calls take, with one
compile per (rows, length) bucket (``rollout.static.compile_dynamic: false``) and with automatic dynamic shapes
(``true``); the tokens against the eager engine's (issue 41, item 1: a bounded compile warm-up).

    python scripts/benchmarks/compile_buckets.py                    # CPU: a 2-layer Qwen2, 30 tokens, buckets of 8
    python scripts/benchmarks/compile_buckets.py --device cuda --model FOLDER --tokens 256 --bucket 64

Each setting runs in its own process (Inductor's in-memory caches would carry over), two calls: G = 2, then G = 3
(another rows bucket). Prints one JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def one(args) -> dict:
    import torch

    from grpo.foundation.tiny import make_tiny_model
    from grpo.rollout.engine import EngineSetup, SamplingParams
    from grpo.rollout.static import StaticEngine
    from grpo.training.configure import load_config

    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.device == "cuda" else None)
    else:
        model = make_tiny_model(97, hidden_size=32, arch="qwen2", num_kv_heads=2)
    model = model.to(args.device).eval()

    def engine(mode: str):
        cfg = load_config(None, "grpo", ["rollout.engine=static", f"rollout.static.mode={mode}",
                                         f"rollout.static.length_bucket={args.bucket}",
                                         f"rollout.static.compile_dynamic={args.dynamic}"])
        return StaticEngine(EngineSetup(cfg=cfg, model=model, tokenizer=None, eos_ids=[2], pad_id=0))

    prompts = [[5 + (i * 7 + j) % 80 for j in range(4 + 3 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True).greedy()
    compiled, counters = engine(args.mode), torch._dynamo.utils.counters
    out = {"compile_dynamic": args.dynamic, "mode": args.mode, "device": args.device, "tokens": args.tokens,
           "length_bucket": args.bucket, "torch": torch.__version__}
    for n in (2, 3):
        before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        got = compiled.generate(prompts, params, n=n)
        if args.device == "cuda":
            torch.cuda.synchronize()
        out[f"G{n}_seconds"] = round(time.perf_counter() - t0, 2)
        out[f"G{n}_graphs"] = counters["stats"]["unique_graphs"] - before
        out[f"G{n}_same_tokens_as_eager"] = got.tokens == engine("eager").generate(prompts, params, n=n).tokens
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help="an HF folder (default: a 2-layer random Qwen2)")
    p.add_argument("--mode", default="compile", help="compile, or compile+graphs on CUDA")
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--bucket", type=int, default=8, help="rollout.static.length_bucket")
    p.add_argument("--dynamic", choices=["true", "false"], help="(internal) one setting in this process")
    args = p.parse_args()
    if args.dynamic:
        print(json.dumps(one(args)))
        return 0
    for dynamic in ("false", "true"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--dynamic", dynamic], capture_output=True,
                              text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        print(proc.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
