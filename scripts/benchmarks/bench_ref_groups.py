#!/usr/bin/env python
"""A streamed run (K = 1, the hf engine with 32 slots, recorded lengths up to 64 tokens) against a reference server
on loopback: each group asked as soon as it is whole (``whole``: ref.ask_groups=true) against the step's groups
asked after the engine call (``after``). Prints the medians of steps 3-12: the wait for the reference's answers
(time/reference), the step, the generation, the requests' latency.

    PYTHONPATH=. python scripts/benchmarks/bench_ref_groups.py whole
    PYTHONPATH=. python scripts/benchmarks/bench_ref_groups.py after
"""
import json
import statistics
import sys
import tempfile

from grpo.training.configure import load_config
from grpo.training.trainer import Trainer
from tests.test_ref_client import serving

side = sys.argv[1] if len(sys.argv) > 1 else "whole"
if side not in ("whole", "after"):
    sys.exit(f"usage: {sys.argv[0]} whole|after")
with serving() as srv:
    out = tempfile.mkdtemp()
    cfg = load_config("configs/demo.yaml", "grpo", [
        f"ref.url={srv.url}", "train.max_steps=12", f"train.output_dir={out}", "train.save_every=0",
        "logging.progress_bar=false", "logging.plot=false", "reward_pool.num_workers=0",
        "rollout.prompts_per_step=8", "rollout.num_generations=8", "rollout.max_completion_length=64",
        "rollout.engine=hf", "rollout.slots=32", "rollout.max_staleness=1", "algo.tis_cap=2.0",
        "rollout.forced_eos_lengths=[3, 5, 8, 12, 20, 30, 45, 64]", f"ref.ask_groups={str(side == 'whole').lower()}"])
    tr = Trainer(cfg)
    try:
        hist = tr._train()
    finally:
        tr.close()
keys = ["time/reference", "time/step", "ref/latency", "ref/early_request", "time/generation"]
rows = hist[2:]
print(side, json.dumps({k: round(statistics.median(h[k] for h in rows if k in h), 4) for k in keys if any(k in h for h in rows)}))
