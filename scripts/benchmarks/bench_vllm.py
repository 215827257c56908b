"""Generation speed of the ``hf`` and ``vllm`` engines with the same settings, and vLLM's sampler/trainer gap.

    .venv-vllm/bin/python scripts/benchmarks/bench_vllm.py --model models/smollm2-135m-instruct --dtype bf16

For each engine: one warm-up call, then ``--repeats`` timed calls of ``--prompts`` prompts x ``--n`` samples,
``--max-tokens`` tokens each (EOS ignored, so both engines produce exactly the same number of tokens).
For vllm also: the weight sync's time, and |log p_vllm - log p_trainer| of the sampled tokens (the
trainer's log-probs computed by the training code, in the same dtype).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.foundation.logprobs import completion_scores, pack  # noqa: E402
from grpo.foundation.modeling import eos_token_ids, load_policy, load_tokenizer  # noqa: E402
from grpo.rollout.engine import EngineSetup, SamplingParams  # noqa: E402
from grpo.training.configure import load_config  # noqa: E402

PROMPTS = ["What is 12 + 35?", "Write a short poem about the sea.", "Name three prime numbers.",
           "Explain what a CPU does.", "What is the capital of France?", "Count from one to five.",
           "Describe a cat in one sentence.", "Why is the sky blue?"]


def build(args, engine: str) -> tuple:
    cfg = load_config(overrides=[f"model.name_or_path={args.model}", f"model.dtype={args.dtype}",
                                 f"rollout.engine={engine}", f"train.output_dir={args.out}",
                                 f"rollout.max_completion_length={args.max_tokens}", "rollout.vllm.check_every=0"])
    model = load_policy(cfg.model)
    tok = load_tokenizer(cfg.model.name_or_path)
    setup = EngineSetup(cfg=cfg, model=model, tokenizer=tok, eos_ids=eos_token_ids(model, tok), pad_id=tok.pad_token_id)
    from grpo.rollout.service import engine_class

    t0 = time.perf_counter()
    eng = engine_class(engine)(setup)
    return eng, setup, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench_vllm")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.engines.split(","):
        eng, setup, start = build(args, name)
        prompts = [setup.tokenizer(t)["input_ids"] for t in (PROMPTS * 4)[: args.prompts]]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
        eng.generate(prompts, SamplingParams(max_tokens=4), 1)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            comp = eng.generate(prompts, params, args.n)
            times.append(time.perf_counter() - t0)
        tokens = sum(len(t) for t in comp.tokens)
        r = {"engine": name, "dtype": args.dtype, "start_s": round(start, 1), "tokens_per_call": tokens,
             "seconds_per_call": round(min(times), 2), "tokens_per_s": round(tokens / min(times), 1)}
        if name == "vllm":
            syncs = []
            for _ in range(3):
                t0 = time.perf_counter()
                eng.sync_weights()
                syncs.append(time.perf_counter() - t0)
            r["sync_s"] = round(min(syncs), 3)
            rows = [q for q in prompts for _ in range(args.n)]
            with torch.no_grad():
                lp = completion_scores(setup.model, pack(rows, comp.tokens, setup.pad_id), 1.0).logprobs
            d = torch.cat([(lp[i, : len(t)].double() - torch.tensor(comp.logprobs[i], dtype=torch.float64)).abs()
                           for i, t in enumerate(comp.tokens)])
            r.update(gap_mean=float(d.mean()), gap_max=float(d.max()), gap_p99=float(d.quantile(0.99)),
                     gap_tokens=int(d.numel()))
            eng.close()
        results[name] = r
        print(json.dumps(r), flush=True)
        del eng
    return 0


if __name__ == "__main__":
    sys.exit(main())
