"""GRPO against a learned reward model alone (scripts/benchmarks/learn_reward_model.py at CI size, ~30-40 s on 2 cores).

A tiny classifier is trained on rule-labelled completions of the digits task; GRPO then optimises it as the only
reward. The model's reward must rise, and the rule reward (never trained on: weight 0 on the training rows, and
greedy answers on held-out items) with it. Also checks the per-source metrics arrive in metrics.jsonl end to end.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

import learn_reward_model as lrm  # noqa: E402


def test_grpo_against_a_learned_reward_model_raises_the_rule_reward(tmp_path):
    rm = lrm.train_reward_model(tmp_path, seconds=0, seed=0, max_steps=300)
    assert rm["rm_steps"] == 300
    assert rm["rm_heldout_corr"] > 0.8, rm  # the classifier learned the rule reward
    assert rm["rm_heldout_mse"] < 0.5 * rm["label_variance"], rm

    recs = lrm.grpo_run(tmp_path, steps=40, seed=0)
    steps = [r for r in recs if "reward/rm/mean" in r]
    assert len(steps) == 40
    rm_first, rm_last = (lrm.window(recs, "reward/rm/mean", f) for f in (True, False))
    rule_first, rule_last = (lrm.window(recs, "reward/digits_match/mean", f) for f in (True, False))
    assert rm_last > rm_first + 0.05, (rm_first, rm_last)
    assert rule_last > rule_first, (rule_first, rule_last)
    held = lrm.heldout_rule_reward(tmp_path / "grpo")
    assert held[0][0] == 0 and len(held) >= 5
    assert max(v for _, v in held[1:]) >= held[0][1] + 0.03, held  # greedy answers on held-out items improve

    # per-source metrics, end to end through train.py
    for r in steps:
        for name in ("rm", "digits_match"):
            for k in ("mean", "std", "errors", "timeouts", "skipped", "latency"):
                assert math.isfinite(r[f"reward/{name}/{k}"]), (name, k)
            assert r[f"reward/{name}/errors"] == 0 and r[f"reward/{name}/skipped"] == 0
        assert r["reward/rm/latency"] > 0
        assert 0 < r["reward/model_time_frac"] < 1
