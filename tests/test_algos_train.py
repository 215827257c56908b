"""Every registered algorithm trains the demo task for 2 steps on 2 DeepSpeed CPU ranks (the second from the
policy the first updated, with the state the first left; prorl 3: its reference reset after step 2 is used at 3).

One 2-rank launch (torchrun) runs them all in turn (tests/algo_smoke_worker.py, with the algorithm's
preset ``configs/NAME.yaml`` (``configs/demo.yaml`` for one without) + ``--algo NAME`` + the
overrides below): starting the launcher costs more than the steps. The test is parametrised over
the registry and checks each algorithm's status, the metrics every algorithm must log
(docs/algorithms.md, "What every algorithm must log") and each algorithm's own quantity.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from algos import ALGORITHMS
from grpo.training.metrics import read_metrics
from tests.conftest import run_deepspeed

pytestmark = pytest.mark.slow
NAMES = sorted(ALGORITHMS)
STEPS = 2
SMALL = ["rollout.prompts_per_step=4", "rollout.num_generations=4", "train.micro_batch_size=6",
         "reward_pool.num_workers=0"]  # the pool has its own tests; 20 trainers need not spawn 40 workers
CLIP = ["clip_frac_low", "clip_frac_high", "ratio_mean"]

# name -> (extra overrides, quantities it must log besides the common ones)
ALGOS: dict[str, tuple[list[str], list[str]]] = {
    "grpo": ([], CLIP + ["kl"]),
    "drgrpo": ([], CLIP),
    "gtpo": ([], CLIP + ["entropy", "gtpo/success_frac", "gtpo/shaped_reward_pos", "gtpo/shaped_reward_neg"]),
    "grpo-s": ([], CLIP + ["entropy", "grpo_s/success_frac", "grpo_s/shaped_reward"]),
    "gspo": ([], CLIP),
    "gspo-token": ([], CLIP),
    "tic-grpo": ([], CLIP),
    "pspo": ([], ["ratio_mean", "smoothed_ratio_mean"]),
    "lambda-grpo": ([], CLIP + ["prefix_count_mean"]),
    "grpo-lambda": ([], CLIP),
    "grpo-lead": ([], CLIP + ["grpo_lead/shaped_reward", "grpo_lead/correct_frac"]),
    "diver": ([], CLIP + ["diver/bonus", "diver/bonus_correct"]),
    "grpo-ps": ([], CLIP + ["grpo_ps/step_reward", "grpo_ps/steps_per_completion"]),
    "dapo": (["algo.overlong_buffer=1", "algo.overlong_filter=true", "algo.max_gen_batches=0"],
             CLIP + ["dapo/kept_frac", "dapo/gen_batches", "dapo/reward_generated_mean", "reward/overlong/mean"]),
    "gpg": (["algo.threshold=0.6", "algo.max_gen_batches=3"], ["gpg/valid_group_frac", "gpg/gen_batches"]),
    "2-grpo": (["rollout.num_generations=2", "rollout.prompts_per_step=8"], CLIP),
    "cppo": (["algo.beta=0.04", "algo.allocation=true"], CLIP + ["cppo/kept_frac", "cppo/prompts", "kl"]),
    "prorl": (["algo.beta=0.001", "algo.reset_every=2", "algo.max_gen_batches=0", "train.max_steps=3"],
              CLIP + ["prorl/ref_version", "prorl/reset", "kl", "dapo/kept_frac"]),
    "dcpo": ([], CLIP + ["dcpo/times_sampled_mean"]),
    # multi-turn: the built-in environments instead of the digits task (rewards are the environment's); mt-grpo
    # with its tool pool (one worker process per rank); gigpo under ZeRO-3, which partitions the weights (and the
    # in-process reference's, beta 0.01), so every LM-head chunk is a collective: small chunks make the ranks'
    # chunk counts differ (they did from the third step and crashed)
    "mt-grpo": (["env.name=calculator", "data.source=env", "data.chat_template=true", "data.prefill='='",
                 "rollout.max_completion_length=4", "rollout.max_turns=2", "rollout.max_trajectory_tokens=24",
                 "env.tool_workers=1"], CLIP + ["reward/turn/mean", "reward/outcome/mean", "env/turns_mean",
                                                "env/tool_calls", "env/tool_errors"]),
    "gigpo": (["env.name=maze", "data.source=env", "data.chat_template=true", "rollout.max_completion_length=1",
               "rollout.max_turns=5", "rollout.max_trajectory_tokens=120", "train.zero_stage=3",
               "train.logprob_chunk_size=32"],
              CLIP + ["kl", "gigpo/anchor_groups", "gigpo/singleton_frac", "env/invalid_per_trajectory",
                      "env/step_limit_frac"]),
    "edge-grpo": (["algo.guided_correction=true", "algo.solution_column=answer", "rollout.max_completion_length=8",
                   "algo.reflection_cue=' ?'"], CLIP + ["edge/corrected_frac", "entropy"]),
    # the peers' algorithms (docs/algorithms.md, "Algorithms from the peers' trainers")
    "cispo": ([], CLIP),
    "sapo": ([], CLIP + ["sapo/gate_mean"]),
    "bnpo": ([], CLIP),
    "luspo": (["algo.num_iterations=2"], CLIP),
    "vespo": ([], CLIP + ["vespo/phi_mean"]),
    "rloo": ([], CLIP),
    "reinforce-pp": (["algo.kl_in_reward=0.01"], CLIP + ["kl_in_reward"]),
    "reinforce-pp-baseline": ([], CLIP),
    "opo": ([], CLIP),
    "optimal-token-baseline": ([], CLIP),
    "grpo-passk": ([], CLIP),
    "gdpo": (["rewards=[{fn: digits_match}, {fn: digits_match, weight: 0.5}]"], CLIP + ["kl"]),
    "remax": (["rollout.num_generations=2"], CLIP + ["remax/baseline_reward"]),
    "clip-cov": (["algo.cov_ratio=0.05"], CLIP + ["cov/dropped_frac"]),
    "kl-cov": (["algo.cov_ratio=0.05"], CLIP + ["cov/penalised_frac"]),
    "geo-mean": (["algo.num_iterations=2"], CLIP),
    "dppo-tv": (["algo.num_iterations=2"], CLIP + ["dppo/capped_frac"]),
    "dppo-kl": (["algo.num_iterations=2"], CLIP + ["dppo/capped_frac"]),
    "dro": ([], CLIP + ["dro/sq_log_ratio"]),  # the preset: dro_beta 0.1, 2 passes
    # on-policy distillation: the preset's in-process teacher, partitioned over the ranks under ZeRO-3 like the
    # reference (its forwards collective), sending its top-4 (the student scored on them with their gradient); the
    # audit on every step (the hf engine's top-k, the partitioned reference's)
    "opd": (["train.zero_stage=3", "train.logprob_chunk_size=32", "teacher.top_k=4", "teacher.beta=0.5",
             "algo.beta=0.01", "logging.audit_every=1", "logging.audit_rows=3"],
            CLIP + ["distill/reverse_kl", "distill/teacher_prob", "distill/share", "time/teacher", "distill/divergence",
                    "audit/sampler_kl", "audit/reference_kl", "time/audit"]),
}
EVERY_STEP = ["reward/mean", "reward/std", "reward/digits_match/mean", "advantage/mean", "advantage/std",
              "advantage/min", "advantage/max", "advantage/zero_group_frac", "completion/length_mean",
              "completion/length_max", "completion/truncated_frac", "lr"]
UPDATE = ["loss", "grad_norm"]


def preset(name: str) -> str:
    """The algorithm's preset, which the smoke run starts from."""
    path = Path("configs") / f"{name}.yaml"
    return str(path) if (Path(__file__).resolve().parent.parent / path).is_file() else "configs/demo.yaml"


def test_every_registered_algorithm_is_covered():
    assert sorted(ALGOS) == NAMES
    assert all(preset(name) != "configs/demo.yaml" for name in NAMES)  # every algorithm has its preset


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("algos")
    plan = out / "plan.json"
    plan.write_text(json.dumps({name: {"config": preset(name), "overrides": SMALL + ALGOS.get(name, ([], []))[0]}
                                for name in NAMES}))
    run_deepspeed(["--plan", str(plan), "--out", str(out), "--steps", str(STEPS)], 2, "tests/algo_smoke_worker.py",
                  launcher="torchrun")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_trains_on_two_ranks(smoke_runs, name):
    run = smoke_runs / name
    status = json.loads((run / "status.json").read_text())
    assert status["ok"], status.get("traceback", status)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, (3 if name == "prorl" else STEPS) + 1))
    own = ALGOS[name][1]
    for r in rows:
        update = [] if r.get("update_skipped") else UPDATE + own
        if r.get("update_skipped"):
            assert name == "gpg", f"{name} skipped an update"
        every = [k for k in EVERY_STEP if "digits_match" not in k] if name in ("mt-grpo", "gigpo") else EVERY_STEP
        for key in every + update:
            assert r.get(key) is not None, f"{name} did not log {key} at step {r['step']}"
            assert math.isfinite(r[key]), (name, key, r[key])
    assert (run / "checkpoints" / "latest").exists()
    if name == "prorl":  # reset after step 2: the reference of step 3 is the policy of step 2
        assert [r["prorl/ref_version"] for r in rows] == [0, 0, 1]
        assert [r["prorl/reset"] for r in rows] == [0, 1, 0]
        assert (run / "reference" / "step-2" / "config.json").is_file()
    if name == "cppo":
        assert all(r["cppo/kept_frac"] == 0.5 and r["cppo/prompts"] == 8 for r in rows)
    if name == "dcpo":  # the per-prompt statistics are in the checkpoint, identical on both ranks
        states = [torch.load(run / "checkpoints" / f"step-{STEPS}" / "trainer" / f"rank{k}.pt", weights_only=False)
                  for k in range(2)]
        stats = states[0]["algo"]["prompt_stats"]
        assert len(stats) == 4 * STEPS and stats == states[1]["algo"]["prompt_stats"]  # 4 prompts a step
    if name == "gpg":
        assert all(r.get("gpg/alpha") is not None or r.get("update_skipped") for r in rows)
    if name in ("mt-grpo", "gigpo"):
        assert all(r["env/turns_mean"] >= 1 and r["grad_norm"] >= 0 for r in rows)  # 0: every group all-equal
    if name == "mt-grpo":  # every first turn is a call (the prefill "="): 2 turns; only calls that ended reach the tool
        assert all(r["env/turns_mean"] == 2 and r["env/tool_calls"] <= 16 for r in rows)
