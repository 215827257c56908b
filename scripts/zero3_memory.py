"""Host memory of building the policy (and the in-process reference) under ZeRO-3: partitioned from the
start (zero.Init) against whole on every rank first. Run it under the launcher, once per mode:

    deepspeed --num_gpus 2 scripts/zero3_memory.py --model DIR --mode partitioned
    deepspeed --num_gpus 2 scripts/zero3_memory.py --model DIR --mode whole

Each rank reports its peak RSS (and current RSS) once the policy's engine is built, and once the
reference is built too and a forward pass has gone through both (so every weight has been read),
and the number of weight elements it holds of each. ``--make-model DIR`` first writes a random-weight model
of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, vocabulary 49152) there.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """This process's resident memory now (VmRSS)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_model(out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--mode", choices=["partitioned", "whole"], default="partitioned")
    p.add_argument("--make-model", help="write a random SmolLM2-135M-shaped model to this folder and exit")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return
    from grpo.foundation import dist
    from grpo.foundation.modeling import load_model
    from grpo.training.partitioned import frozen_partitioned, load_partitioned
    from grpo.training import deepspeed_engine as ds
    from grpo.training.configure import load_config

    ds.init_distributed()
    cfg = load_config(overrides=[f"model.name_or_path={args.model}", "train.zero_stage=3", "model.dtype=fp32",
                                 "model.gradient_checkpointing=false"])
    base = peak_mb()
    partitioned = args.mode == "partitioned"
    conf = ds.deepspeed_config(cfg)
    model = load_partitioned(cfg, args.model, conf) if partitioned else load_model(cfg.model)
    loaded = rss_mb()
    engine, _ = ds.build_engine(cfg, model)
    after_policy, rss_policy = peak_mb(), rss_mb()
    held = sum(getattr(q, "ds_tensor", q).numel() for q in engine.module.parameters())
    ref = frozen_partitioned(cfg, args.model, conf) if partitioned else load_model(cfg.model, args.model).eval().requires_grad_(False)
    import torch

    ids = torch.ones((1, 4), dtype=torch.long)
    with torch.no_grad():  # a forward through each touches every weight (a whole load is memory-mapped until then)
        engine.module(input_ids=ids)
        ref(input_ids=ids)
    after_ref, rss_ref = peak_mb(), rss_mb()
    ref_held = sum(getattr(q, "ds_tensor", q).numel() for q in ref.parameters())
    rows = dist.all_gather_object({"rank": dist.rank(), "mode": args.mode, "peak_mb_start": round(base),
                                   "peak_mb_after_policy": round(after_policy), "peak_mb_after_reference": round(after_ref),
                                   "rss_mb_model_loaded": round(loaded), "rss_mb_engine": round(rss_policy),
                                   "rss_mb_with_reference": round(rss_ref),
                                   "policy_elements_held": held, "reference_elements_held": ref_held})
    if dist.is_main():
        print(json.dumps(rows))
    dist.shutdown()


if __name__ == "__main__":
    main()
