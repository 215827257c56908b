"""Resume a vllm-engine run (argv: config overrides) and report, as JSON on the last line, what vLLM serves
before the run's first generation: the weight syncs so far, and the probe's gap (vLLM against the restored
trainer) and the gap of the initial weights (what vLLM would serve without the resume's sync)."""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from grpo.foundation.logprobs import completion_scores, pack
    from grpo.foundation.modeling import load_policy
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    cfg = load_config("configs/demo.yaml", "grpo", sys.argv[1:])
    tr = Trainer(cfg, resume=True)
    eng = tr.rollout.engine
    syncs = eng.syncs
    batch = tr.generate(tr._rank_indices())  # the resumed run's first generation
    _, gap, tokens = eng.probe_gap(8)
    prompts, comps = eng._last
    prompts, comps = prompts[:8], comps[:8]
    with torch.no_grad():
        now = completion_scores(tr.model, pack(prompts, comps, tr.tokenizer.pad_token_id), 1.0).logprobs
        init = completion_scores(load_policy(cfg.model), pack(prompts, comps, tr.tokenizer.pad_token_id), 1.0).logprobs
    mask = torch.zeros_like(now, dtype=torch.bool)
    for i, c in enumerate(comps):
        mask[i, : len(c)] = True
    stale = float((now - init).abs()[mask].mean())  # the probe's statistic (mean over tokens)
    tr.close()
    print(json.dumps({"step": tr.step, "syncs": syncs, "gap": gap, "tokens": tokens, "stale_gap": stale,
                      "rows": len(batch)}), flush=True)


if __name__ == "__main__":
    main()
