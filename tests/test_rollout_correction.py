"""Rollout correction (issue 45, item 2: ``algo.rollout_correction``): the weights at the token, sequence and
geometric levels, truncated or masked, against float64 loops written out here; TRL 1.16's
vllm_importance_sampling_mode (token / sequence, truncate / mask) and verl's rollout-correction weights and rejection
masks as their code defines them; tis_cap as one setting;
the loss and the step's mismatch metrics by hand; the config's refusals; two Trainer steps on the hf engine."""

from __future__ import annotations

import math

import pytest
import torch

from algos import ALGORITHMS
from grpo.foundation import rl_math
from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import StepContext
from tests.helpers import config, make_batch, policy_logp


def weight(old_logp, sampler_logp, mask, level, mode, high, low=None):
    """Rollout correction's weight as the trainer forms it (loss_options.correct_rollout)."""
    return rl_math.bound_ratio(rl_math.rollout_ratio(old_logp, sampler_logp, mask, level), mode, high, low)

LENGTHS = [3, 5, 1, 4, 2, 2, 5, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5]
G, W = 4, 5
RC = "algo.rollout_correction"


def sampler_logp(batch, seed=3, spread=1.6):
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(batch.mask.shape, generator=g, dtype=torch.float64) - 0.5) * spread
    return (batch.old_logp + noise) * batch.mask


def hand_weights(old, samp, mask, level, mode, high, low):
    """Row by row, token by token."""
    out = []
    for o, s, m in zip(old.tolist(), samp.tolist(), mask.tolist()):
        d = [(a - b) if k else 0.0 for a, b, k in zip(o, s, m)]
        n = max(1, int(sum(m)))
        if level == "token":
            r = [math.exp(x) for x in d]
        else:
            v = math.exp(sum(d) if level == "sequence" else sum(d) / n)
            r = [v] * len(d)
        lo = -math.inf if low is None else low
        if mode == "truncate":
            out.append([min(max(x, lo), high) for x in r])
        else:
            out.append([x if lo <= x <= high else 0.0 for x in r])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("low", [None, 0.6])
def test_weights_by_hand(level, mode, low):
    batch = make_batch(LENGTHS, REWARDS, G, W)
    samp = sampler_logp(batch)
    got = weight(batch.old_logp, samp, batch.mask, level, mode, 1.5, low)
    want = hand_weights(batch.old_logp, samp, batch.mask, level, mode, 1.5, low)
    m = batch.mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-15, atol=0)
    if mode == "mask":
        assert (got[m] == 0).any() and (got[m] != 0).any()  # the bounds bite on some rows or tokens, not all


def test_tis_cap_is_token_truncate_without_a_lower_bound():
    batch = make_batch(LENGTHS, REWARDS, G, W)
    samp = sampler_logp(batch)
    torch.testing.assert_close(weight(batch.old_logp, samp, batch.mask, "token", "truncate",
                                                                 1.3),
                               rl_math.tis_weight(batch.old_logp, samp, batch.mask, 1.3), rtol=0, atol=0)


@pytest.mark.parametrize("trl_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min", [None, 0.5])
def test_equal_to_trls_vllm_importance_sampling_mode(trl_mode, clip_min):
    """TRL 1.16, GRPOTrainer._generate_and_score_completions: diff = (old - sampling) * mask; token modes exp(diff),
    sequence modes exp(diff.sum(-1)); *_truncate clamp(ratio, clip_min, clip_max), *_mask ratio with 0 where it is
    below clip_min or above clip_max. Written out from that definition; ours on the completion tokens."""
    batch = make_batch(LENGTHS, REWARDS, G, W)
    samp = sampler_logp(batch)
    diff = (batch.old_logp - samp) * batch.mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if trl_mode.startswith("sequence") else diff)
    if trl_mode.endswith("truncate"):
        trl = torch.clamp(ratio, min=clip_min, max=3.0)
    else:
        lo = clip_min if clip_min is not None else -math.inf
        trl = ratio.masked_fill((ratio < lo) | (ratio > 3.0), 0.0)
    level, mode = trl_mode.split("_")
    ours = weight(batch.old_logp, samp, batch.mask, level, mode, 3.0, clip_min)
    m = batch.mask.bool()
    torch.testing.assert_close(ours[m], trl.expand_as(ours)[m], rtol=0, atol=0)


def verl_weights(old, samp, mask, level):
    """verl's rollout_corr_helper: log_ratio = old - rollout; token: exp(clamp(d, -20, 20)); sequence:
    exp(clamp(sum_t d, -20, 20)); geometric (rejection only): exp(clamp(mean_t d, -20, 20)); padding weights 0."""
    d = (old - samp) * mask
    if level == "token":
        agg = d
    elif level == "sequence":
        agg = d.sum(-1, keepdim=True)
    else:
        agg = d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    return torch.exp(agg.clamp(-20.0, 20.0)).expand_as(d) * mask


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncate_equals_verls_truncated_importance_weights(level):
    """verl's compute_rollout_correction_weights (rollout_is=level, rollout_is_threshold=C): the weights clamped at
    C from above, no lower bound = ours {level, mode: truncate, high: C, low: null}."""
    batch = make_batch(LENGTHS, REWARDS, G, W)
    samp = sampler_logp(batch, spread=2.4)
    verl = verl_weights(batch.old_logp, samp, batch.mask, level).clamp(max=1.7)
    ours = weight(batch.old_logp, samp, batch.mask, level, "truncate", 1.7)
    m = batch.mask.bool()
    torch.testing.assert_close(ours[m], verl[m], rtol=1e-15, atol=0)


VERL_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def verl_k1_keep(old, samp, mask, option, lower, upper):
    """verl's compute_rollout_rejection_mask (verl/trainer/ppo/rollout_corr_helper.py) with one k1 option and
    rollout_rs_threshold "lower_upper": log_ratio = old - rollout, clamped to +-20; token_k1 = -log_ratio (the
    log of sampler / old); seq_sum_k1 and seq_mean_k1 its masked sum and mean over the completion; a token (or
    every token of a sequence) is kept where log(lower) <= statistic <= log(upper)."""
    k1 = -((old - samp).clamp(-20.0, 20.0)) * mask
    if option == "token_k1":
        stat = k1
    elif option == "seq_sum_k1":
        stat = k1.sum(-1, keepdim=True).expand_as(k1)
    else:
        stat = (k1.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(k1)
    return ((stat >= math.log(lower)) & (stat <= math.log(upper))).double() * mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mask_keeps_what_verls_k1_rejection_keeps(level):
    """verl's k1 rejection options (token_k1, seq_sum_k1, seq_mean_k1) bound sampler / old, ours old / sampler: ours
    {level, mode: mask, low: L, high: H} keeps exactly what verl's option at that level keeps with rollout_rs_threshold
    "1/H_1/L" (issue 58 item 19: asymmetric bounds show the mapping), and weights the kept tokens by the ratio: at the
    token and sequence levels that is verl's truncated importance weight (rollout_is at the same level, threshold H)
    times its rejection mask, exactly. verl has no geometric importance weight: there the kept set is the same. Mask
    mode at the token level is IcePop (Ring-1T: low 1/beta, high beta)."""
    batch = make_batch(LENGTHS, REWARDS, G, W)
    samp = sampler_logp(batch, spread=2.4)
    high, low = 1.7, 0.8
    keep = verl_k1_keep(batch.old_logp, samp, batch.mask, VERL_RS[level], 1 / high, 1 / low)
    ours = weight(batch.old_logp, samp, batch.mask, level, "mask", high, low)
    m = batch.mask.bool()
    assert torch.equal(ours[m] != 0, keep[m].bool())
    assert keep[m].any() and (keep[m] == 0).any()  # the bounds bite
    # the bounds taken as verl's own (not inverted) keep another set: the mapping matters
    assert not torch.equal(verl_k1_keep(batch.old_logp, samp, batch.mask, VERL_RS[level], low, high)[m], keep[m])
    if level != "geometric":
        w = verl_weights(batch.old_logp, samp, batch.mask, level)
        torch.testing.assert_close(ours[m], (w.clamp(max=high) * keep)[m], rtol=1e-15, atol=0)


def test_grpo_loss_and_the_steps_metrics_with_a_correction_by_hand():
    cfg = config("grpo", **{RC: "{level: geometric, mode: mask, high: 1.2, low: 0.8}", "rollout.engine": "static"})
    algo = ALGORITHMS.get("grpo")(cfg)
    assert algo.needs_old_logprobs
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.sampler_logp = sampler_logp(batch, spread=0.8)
    ctx = StepContext(cfg, 0)
    batch.advantages = algo.advantages(batch, ctx)
    batch = algo.prepare_loss(batch, ctx)
    w = hand_weights(batch.old_logp, batch.sampler_logp, batch.mask, "geometric", "mask", 1.2, 0.8)
    m = batch.mask.bool()
    d = (batch.old_logp - batch.sampler_logp)[m].tolist()
    assert ctx.metrics["rollout_corr/k1"] == pytest.approx(-sum(d) / len(d), rel=1e-12)
    assert ctx.metrics["rollout_corr/k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / len(d), rel=1e-12)
    assert ctx.metrics["rollout_corr/ratio_max"] == pytest.approx(math.exp(max(d)), rel=1e-12)
    assert ctx.metrics["rollout_corr/ratio_min"] == pytest.approx(math.exp(min(d)), rel=1e-12)
    assert ctx.metrics["rollout_corr/weight_mean"] == pytest.approx(float(w[m].mean()), rel=1e-12)
    masked = float((w[m] == 0).double().mean())
    assert ctx.metrics["rollout_corr/masked_frac"] == pytest.approx(masked, rel=1e-12) and 0 < masked < 1
    # the loss: GRPO's per-token terms times w, the KL term unweighted
    logp = policy_logp(batch)
    norms = rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)
    out = algo.loss(logp, batch, norms)
    plain = ALGORITHMS.get("grpo")(config("grpo"))
    ref = batch.extra.pop("rollout_weight")
    assert torch.equal(ref, w.to(ref.dtype))
    adv, eps, beta = batch.advantages.tolist(), 0.2, 0.04
    total = 0.0
    lp, old, rl, mk = logp.detach().tolist(), batch.old_logp.tolist(), batch.ref_logp.tolist(), batch.mask.tolist()
    for i in range(len(mk)):
        n, row = int(sum(mk[i])), 0.0
        for t in range(n):
            rho = math.exp(lp[i][t] - old[i][t])
            surr = min(rho * adv[i], min(max(rho, 1 - eps), 1 + eps) * adv[i])
            kd = rl[i][t] - lp[i][t]
            row += surr * w[i, t].item() - beta * (math.exp(kd) - kd - 1)
        total += row / n
    assert out.loss.item() == pytest.approx(-total / len(mk), rel=1e-12, abs=1e-14)
    assert plain.loss(logp.detach(), batch, norms).loss.item() != pytest.approx(out.loss.item())


@pytest.mark.parametrize("algo, overrides, match", [
    ("grpo", {"algo.tis_cap": 2.0, RC: "{high: 2.0}"}, r"algo.tis_cap=2.0 and algo.rollout_correction: tis_cap is "
                                                       r"rollout_correction=\{level: token, mode: truncate, high: 2.0\}"),
    ("grpo", {RC: "{high: 2.0, low: 2.0}"}, r"algo.rollout_correction.low=2.0 must be < algo.rollout_correction.high"),
    ("grpo", {RC: "{level: batch}"}, r"algo.rollout_correction.level='batch' is invalid"),
    # issue 58 item 4: mask mode outside low < 1 < high masks every on-policy token (masked_frac 1, grad_norm 0)
    ("grpo", {RC: "{mode: mask, high: 0.2}"}, r"algo.rollout_correction.high=0.2 with mode=mask would mask every "
                                              r"on-policy token .* needs low < 1 < high"),
    ("grpo", {RC: "{mode: mask, high: 1.0}"}, r"algo.rollout_correction.high=1.0 with mode=mask"),
    ("grpo", {RC: "{mode: mask, high: 3.0, low: 1.5}"}, r"algo.rollout_correction.low=1.5 with mode=mask"),
    ("grpo", {RC: "{high: 0}"}, r"algo.rollout_correction.high=0.0 is invalid: it must be > 0"),
    ("gspo", {RC: "{high: 2.0}"}, r"algo.rollout_correction weights each token's policy-gradient term, and gspo has a "
                                  r"sequence-level loss"),
    ("grpo", {RC: "{high: 2.0}", "env.name": "maze"}, "not supported with multi-turn rollouts"),
    ("edge-grpo", {RC: "{high: 2.0}", "algo.guided_correction": True}, "algo.rollout_correction with "
                                                                        "algo.guided_correction"),
])
def test_config_errors(algo, overrides, match):
    with pytest.raises(ConfigError, match=match):
        config(algo, **overrides)


def test_truncate_bounds_that_exclude_1_are_warned_about():
    """Issue 58 item 4: truncate with high < 1 clamps every on-policy token's weight: valid, warned at start."""
    from grpo.foundation.config_rules import config_warnings

    assert config_warnings(config("grpo", **{RC: "{mode: mask, high: 2.0, low: 0.5}"})) == []
    assert config_warnings(config("grpo", **{RC: "{high: 2.0}"})) == []
    (warning,) = config_warnings(config("grpo", **{RC: "{high: 0.5}"}))
    assert "algo.rollout_correction.high=0.5 < 1 with mode=truncate" in warning and "clamped to 0.5" in warning
    (warning,) = config_warnings(config("grpo", **{RC: "{high: 3.0, low: 1.5}"}))
    assert "algo.rollout_correction.low=1.5 > 1 with mode=truncate" in warning


def test_two_steps_on_the_hf_engine_log_the_mismatch(single_rank_env, tmp_path):
    """The hf engine samples with the trainer's own weights: a fresh sampler, weights 1 and k1 ~ 0 (rounding)."""
    from pathlib import Path

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    cfg = load_config(demo, "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=2",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
        "rollout.engine=hf", "model.dtype=fp32", f"{RC}={{level: sequence, mode: mask, high: 2.0, low: 0.5}}"])
    history = Trainer(cfg).train()
    for h in history:
        assert abs(h["rollout_corr/k1"]) < 1e-5 and h["rollout_corr/k3"] < 1e-8
        assert h["rollout_corr/masked_frac"] == 0 and h["rollout_corr/weight_mean"] == pytest.approx(1, abs=1e-4)
        assert h["rollout_corr/ratio_min"] <= 1 <= h["rollout_corr/ratio_max"] < 1 + 1e-4


@pytest.mark.parametrize("engine", ["hf", "tests.stale_engine:StaleEngine"])
def test_a_stale_sampler_is_flagged_and_masked_a_fresh_one_is_not(single_rank_env, tmp_path, capsys, engine):
    """Issue 45: a sampler that kept the step-0 weights (never synced) drifts from the trainer with every update: its
    tokens' ratios leave [0.8, 1.25] and are masked, and the health check names stale weights; the hf engine samples
    with the trainer's own weights: nothing masked, no warning."""
    from pathlib import Path

    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    cfg = load_config(demo, "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "train.max_steps=4",
        "rollout.prompts_per_step=8", "rollout.num_generations=4", "reward_pool.num_workers=0", "algo.beta=0",
        f"rollout.engine={engine}", "model.dtype=fp32", "train.lr=0.05", "logging.health_patience=1",
        f"{RC}={{level: token, mode: mask, low: 0.8, high: 1.25}}",
        "algo.entropy_coef=0.5"])  # the untrained model's rewards are all 0: the entropy bonus moves the weights
    history = Trainer(cfg).train()
    err = capsys.readouterr().err
    first, last = history[0], history[-1]
    assert first["rollout_corr/masked_frac"] == 0 and abs(first["rollout_corr/k1"]) < 1e-5  # step 1: same weights
    if engine == "hf":
        assert all(h["rollout_corr/masked_frac"] == 0 and h["sampler_gap/mean"] < 1e-4 for h in history)
        assert "log-probs of its own tokens differ" not in err
    else:
        assert last["rollout_corr/masked_frac"] > 0.05 and last["rollout_corr/k3"] > 100 * max(first["rollout_corr/k3"],
                                                                                                 1e-12)
        assert last["sampler_gap/mean"] > 0.1 and "stale weights" in err and "rollout.engine=tests.stale_engine" in err
