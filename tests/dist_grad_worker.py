"""Run on 2 ranks (tests.conftest.run_deepspeed), or in a test process (``run_cases``: a world of one): the full
gradient of one step on a fixed global batch.

Every rank builds the same 16-row batch, takes its own groups, and accumulates gradients
through the real Trainer/DeepSpeed path; rank 0 writes the gathered gradient for each
aggregation. The test compares world sizes, micro-batch sizes and ZeRO stages (several of them in one launch with
``--case``: each launch costs the ranks' start). A run named NAME+lora: the
policy has LoRA adapters (B made non-zero, the same on every rank) and the gradient is the adapters'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# torch, DeepSpeed and the trainer are imported inside the functions: each reward worker of a train run in this
# launch (run_plan) runs this script's top level again (multiprocessing's preparation), ~4 s of imports each

LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, k_proj, v_proj, o_proj, up_proj, down_proj]}"

GROUPS, G, WIDTH = 4, 4, 6
CHUNK_Z3 = 7  # rank 0 needs 2 and 3 chunks for its micro-batches, rank 1 needs 2 and 2


def global_batch(vocab: int):
    import torch

    from grpo.foundation.batch import RolloutBatch

    g = torch.Generator().manual_seed(1234)
    rows = GROUPS * G
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g).tolist()
    prompts = [torch.randint(4, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(GROUPS)]
    comps = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
    rewards = torch.randint(0, 3, (rows,), generator=g).float()
    rewards[4:8] = 1.0  # one all-equal group
    return RolloutBatch(
        prompt_ids=[prompts[i // G] for i in range(rows)], completion_ids=comps,
        mask=(torch.arange(WIDTH).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float(),
        truncated=torch.zeros(rows, dtype=torch.bool), group_size=G, prompt_index=[i // G for i in range(rows)],
        items=[{}] * rows, prompt_text=[""] * rows, completion_text=[""] * rows, rewards=rewards,
    )


def one_run(micro: str, zero: int, model: str, lora: bool, out_dir: Path) -> dict:
    """The gathered gradient and loss of the fixed batch for every aggregation, and with an entropy bonus (on
    rank 0; {} elsewhere).
    ``micro``: rows per micro-batch, or ROWS/TOKENS for a token budget (train.micro_batch_tokens) too."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    from grpo.foundation import rl_math, dist
    from grpo.foundation.batch import micro_batches
    from grpo.training.configure import load_config
    import grpo.training.deepspeed_engine as ds_module
    from grpo.training.trainer import Trainer

    rows_per, _, tokens = str(micro).partition("/")
    cfg = load_config(overrides=[*([LORA] if lora else []),
        "algo.beta=0", "train.lr=0", f"train.micro_batch_size={rows_per}", f"train.zero_stage={zero}",
        f"train.micro_batch_tokens={tokens or 0}",
        f"rollout.max_completion_length={WIDTH}", f"train.output_dir={out_dir}",
        "logging.progress_bar=false", "rollout.prompts_per_step=4", f"rollout.num_generations={G}",
        f"model.name_or_path={model}", "reward_pool.num_workers=0",  # no rewards are computed here
        # ZeRO-3: LM-head chunks of 7 tokens, so the ranks' micro-batches need unequal numbers of them
        *([f"train.logprob_chunk_size={CHUNK_Z3}"] if zero == 3 else []),
    ])
    base = ds_module.deepspeed_config
    if zero == 3:  # partition every weight, even the tiny model's (DeepSpeed keeps small ones whole)
        def partition_all(c):
            ds = base(c)
            ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            return ds

        ds_module.deepspeed_config = partition_all
    try:
        trainer = Trainer(cfg)
    finally:
        ds_module.deepspeed_config = base
    if zero == 3:
        assert all(p.ds_tensor.numel() < p.ds_numel for p in trainer.model.parameters()), "weights not partitioned"
    full = global_batch(trainer.model.config.vocab_size)
    per = GROUPS // dist.world_size()
    rows = list(range(dist.rank() * per * G, (dist.rank() + 1) * per * G))
    batch = full.select(rows)
    batch.advantages = trainer.algo.advantages(batch, None)
    results = {}
    # each rank's own micro-batches (before the padding to the busiest rank's count)
    mbs = micro_batches(trainer._total_lengths(batch), int(rows_per), int(tokens or 0))
    results["micro_batches_per_rank"] = dist.all_gather_object(len(mbs))
    results["passes_per_rank"] = dist.all_gather_object(len(trainer.micro_batches(batch)))
    if zero == 3:  # each rank's LM-head chunks per micro-batch: the test checks that they differ
        chunks = [-(-int(batch.mask[mb].sum()) // CHUNK_Z3) for mb in mbs]
        results["head_chunks_per_rank"] = dist.all_gather_object(chunks)
    # every aggregation; then an entropy bonus (algo.entropy_coef: the entropy's gradient through the LM head)
    for name in [*rl_math.AGGREGATIONS, "entropy-bonus"]:
        if name == "entropy-bonus":
            cfg.algo.aggregation, cfg.algo.entropy_coef = "seq-mean-token-mean", 0.5
            trainer.algo.entropy_alpha = 0.5
        else:
            cfg.algo.aggregation = name
        loss = trainer.accumulate_gradients(batch, trainer.step_norms(batch), {})
        grads = [safe_get_full_grad(p) for p in trainer.model.parameters() if p.requires_grad]
        total_loss = dist.all_reduce_sum(loss.reshape(1))
        if dist.is_main():
            results[name] = {"loss": float(total_loss), "grad": torch.cat([g.reshape(-1).double() for g in grads])}
        trainer.engine.step()  # lr = 0: clears the gradients, changes no weight
    trainer.close()
    return results


def per_aggregation(results: dict) -> dict:
    """One run's {aggregation (and "entropy-bonus"): {"loss", "grad"}}, without the per-rank counts beside them."""
    return {k: v for k, v in results.items() if isinstance(v, dict)}


def run_cases(cases: list[str], default_model: str, out_dir: Path) -> dict:
    """{NAME: one_run's results} for each ``NAME:MICRO:ZERO[:MODEL]`` in turn (also called in a test process: a
    world of one). LoRA starts at B = 0 (A's gradient would be 0): here with a seeded non-zero B, before the engine
    copies it (models without adapters are unchanged)."""
    import torch

    import grpo.training.trainer as trainer_module

    load_policy = trainer_module.load_policy

    def with_b(cfg_model):
        model = load_policy(cfg_model)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, prm in model.named_parameters():
                if "lora_B" in n:
                    prm.copy_(torch.randn(prm.shape, generator=g) * 0.05)
        return model

    trainer_module.load_policy = with_b
    try:
        results = {}
        for spec in cases:
            name, micro, zero, *model = spec.split(":", 3)
            results[name] = one_run(micro, int(zero), model[0] if model else default_model, name.endswith("+lora"),
                                    out_dir / f"run-{name}")
        return results
    finally:
        trainer_module.load_policy = load_policy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--model", default="builtin:tiny-char", help="under ZeRO-3 an HF folder is built partitioned")
    p.add_argument("--case", action="append", required=True, metavar="NAME:MICRO:ZERO[:MODEL]",  # MICRO: ROWS or ROWS/TOKENS; NAME+lora: with LoRA
                   help="the runs of this one launch (--out then holds {NAME: results})")
    p.add_argument("--plan", nargs=2, metavar=("PLAN", "OUT"), help="first, the train runs of a "
                   "tests/algo_smoke_worker.py plan (JSON file PLAN; statuses under OUT): one rank start-up less")
    p.add_argument("--zero3-checks", nargs=2, metavar=("MODEL", "JSON"), help="then tests/zero3_generate_worker.py's "
                   "checks on the HF folder MODEL (in this launch: one rank start-up less), written to JSON")
    args = p.parse_args()
    import torch

    from grpo.foundation import dist

    if args.plan:
        from tests.algo_smoke_worker import run_plan

        run_plan(json.loads(Path(args.plan[0]).read_text()), Path(args.plan[1]))
    out = Path(args.out)
    results = run_cases(args.case, args.model, out.parent)
    if dist.is_main():
        torch.save(results, out)
    if args.zero3_checks:
        from tests.zero3_generate_worker import write_checks_and_exit

        write_checks_and_exit(args.zero3_checks[0], Path(args.zero3_checks[1]))  # does not return


if __name__ == "__main__":
    main()
