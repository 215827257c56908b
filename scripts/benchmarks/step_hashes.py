#!/usr/bin/env python
"""Hashes of a short run, to check that a change leaves the trainer bit for bit as it was: three demo steps on the
static engine (fp32, 8 prompts x 8, 8 tokens, beta 0), printed as sha256 of every generation call's tokens, the three
losses, and sha256 of the weights after the last update. Run it from each commit's tree and compare the lines:

    PYTHONPATH=. python scripts/benchmarks/step_hashes.py /tmp/run [override ...]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")


def main(out: str, *overrides: str) -> dict:
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    cfg = load_config("configs/demo.yaml", "grpo", [
        f"train.output_dir={out}", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=3",
        "rollout.engine=static", "model.dtype=fp32", "reward_pool.num_workers=0", "train.save_every=0",
        "rollout.prompts_per_step=8", "rollout.num_generations=8", "rollout.max_completion_length=8", "algo.beta=0",
        *overrides])
    tr = Trainer(cfg)
    tokens, inner = [], tr.rollout.generate

    def spy(*args, **kwargs):
        done = inner(*args, **kwargs)
        tokens.append(done.tokens)
        return done

    tr.rollout.generate = spy
    try:
        history = tr.train()
        weights = hashlib.sha256()
        for _, v in sorted(tr.model.state_dict().items()):
            weights.update(v.detach().cpu().numpy().tobytes())
    finally:
        tr.close()
    return {"tokens": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(), "losses": [h["loss"] for h in history],
            "weights": weights.hexdigest()}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
