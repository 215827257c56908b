"""Truncated importance sampling (``algo.tis_cap``) and the sampler/trainer gap metric, by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch

from algos.gpg import GPG
from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import ConfigError
from grpo.training.metrics import SamplerGap
from tests.helpers import config, make_batch, policy_logp

LENGTHS = [3, 5, 1, 4, 2, 2, 5, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5]
G, W = 4, 5
ENGINE = "rollout.engine"
SCRIPTED = "tests.scripted_engine:ScriptedEngine"


def sampler_logp(batch, seed=3):
    """The sampler's log-probs: the old ones moved by up to +-1.5, so some weights exceed the cap."""
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(batch.mask.shape, generator=g, dtype=torch.float64) - 0.5) * 3
    return (batch.old_logp + noise) * batch.mask


def hand_grpo_tis_loss(batch, logp, adv, cap, eps=0.2, beta=0.04):
    """-(1/N) sum_i 1/|o_i| sum_t [min(rho A, clip(rho) A) * min(pi_old/pi_sampler, C) - beta k3]."""
    logp, old, ref = logp.tolist(), batch.old_logp.tolist(), batch.ref_logp.tolist()
    samp, mask = batch.sampler_logp.tolist(), batch.mask.tolist()
    total = 0.0
    for i in range(len(mask)):
        L = int(sum(mask[i]))
        row = 0.0
        for t in range(L):
            rho = math.exp(logp[i][t] - old[i][t])
            surr = min(rho * adv[i], min(max(rho, 1 - eps), 1 + eps) * adv[i])
            w = 1.0 if cap is None else min(math.exp(old[i][t] - samp[i][t]), cap)
            d = ref[i][t] - logp[i][t]
            row += surr * w - beta * (math.exp(d) - d - 1)
        total += row / L
    return -total / len(mask)


def test_grpo_loss_and_gradient_with_tis_by_hand():
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.sampler_logp = sampler_logp(batch)
    cap = 1.5
    algo = GRPO(config(**{"algo.tis_cap": cap, ENGINE: SCRIPTED}))
    batch.advantages = algo.advantages(batch, None)
    adv = batch.advantages.tolist()
    logp = policy_logp(batch)
    norms = rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)
    out = algo.loss(logp, batch, norms)
    assert out.loss.item() == pytest.approx(hand_grpo_tis_loss(batch, logp.detach(), adv, cap), rel=1e-12, abs=1e-12)
    # the cap binds on some tokens and not on others
    capped, count = out.stats["tis/capped_frac"]
    assert 0 < capped.item() < count.item()
    # and the weights are constants: the gradient is the hand formula's, finite differences on a few tokens
    out.loss.backward()
    for i, t in [(0, 0), (1, 4), (3, 2), (6, 3)]:
        h = 1e-6
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i, t] += h
        minus[i, t] -= h
        fd = (hand_grpo_tis_loss(batch, plus, adv, cap) - hand_grpo_tis_loss(batch, minus, adv, cap)) / (2 * h)
        assert logp.grad[i, t].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)
    # without a cap (the default) the sampler's log-probs are not used: plain GRPO
    plain = GRPO(config(**{ENGINE: SCRIPTED})).loss(logp.detach(), batch, norms).loss.item()
    assert plain == pytest.approx(hand_grpo_tis_loss(batch, logp.detach(), adv, cap=None), rel=1e-12, abs=1e-12)
    assert plain != pytest.approx(out.loss.item())


def test_gpg_with_tis_by_hand():
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.old_logp = None  # on-policy: pi_old = sg[pi]
    batch.sampler_logp = sampler_logp(make_batch(LENGTHS, REWARDS, G, W))
    cap = 2.0
    algo = GPG(config("gpg", **{"algo.tis_cap": cap, ENGINE: SCRIPTED}))
    batch.advantages = algo.advantages(batch, None)
    algo.alpha = 1.0
    logp = policy_logp(batch)
    out = algo.loss(logp, batch, rl_math.StepNorms(len(batch), float(batch.mask.sum()), W))
    lp, samp, mask, adv = logp.tolist(), batch.sampler_logp.tolist(), batch.mask.tolist(), batch.advantages.tolist()
    # GPG: token-mean over the step, L = -(1/sum|o_i|) sum_i sum_t l A_i w (alpha = 1 here)
    total, tokens = 0.0, 0
    for i in range(len(mask)):
        L = int(sum(mask[i]))
        total += sum(-lp[i][t] * adv[i] * min(math.exp(lp[i][t] - samp[i][t]), cap) for t in range(L))
        tokens += L
    assert out.loss.item() == pytest.approx(total / tokens, rel=1e-12, abs=1e-12)


def test_padding_never_overflows_the_weight():
    old = torch.tensor([[-1.0, 500.0]], dtype=torch.float64)
    samp = torch.tensor([[-2.0, -500.0]], dtype=torch.float64)
    w = rl_math.tis_weight(old, samp, torch.tensor([[1.0, 0.0]], dtype=torch.float64), 2.0)
    assert w.tolist() == [[2.0, 1.0]]
    assert rl_math.tis_weight(old[:, :1], samp[:, :1] + 0.5, torch.ones(1, 1), 5.0).item() == pytest.approx(math.exp(0.5))


def test_tis_needs_the_samplers_log_probs():
    batch = make_batch(LENGTHS, REWARDS, G, W)
    algo = GRPO(config(**{"algo.tis_cap": 2.0, ENGINE: SCRIPTED}))
    batch.advantages = algo.advantages(batch, None)
    with pytest.raises(RuntimeError, match="returned none"):
        algo.loss(policy_logp(batch), batch, rl_math.StepNorms(len(batch), float(batch.mask.sum()), W))


@pytest.mark.parametrize("overrides, match", [
    ({"algo.tis_cap": "nan", ENGINE: SCRIPTED}, "algo.tis_cap"),
    ({"algo.tis_cap": 0, ENGINE: SCRIPTED}, r"algo.tis_cap=0.0 is invalid: it must be > 0"),
    ({"algo.tis_cap": 2.0, ENGINE: SCRIPTED, "env.name": "maze"}, "multi-turn"),
])
def test_tis_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config(**overrides)


@pytest.mark.parametrize("algo", ["gspo", "grpo-s", "tic-grpo"])
def test_sequence_level_algorithms_refuse_tis(algo):
    with pytest.raises(ConfigError, match="sequence-level loss"):
        config(algo, **{"algo.tis_cap": 2.0, ENGINE: SCRIPTED})
    config("gspo-token", **{"algo.tis_cap": 2.0, ENGINE: SCRIPTED})  # per-token surrogate: accepted


def test_edge_grpo_guided_correction_refuses_tis():
    """Issue 30, item 12: its rewritten rows kept the old rows' sampler log-probs (a TIS weight ~ p_old)."""
    with pytest.raises(ConfigError, match=r"algo.tis_cap=2.0 with algo.guided_correction"):
        config("edge-grpo", **{"algo.tis_cap": 2.0, "algo.guided_correction": True, ENGINE: SCRIPTED})
    config("edge-grpo", **{"algo.tis_cap": 2.0, ENGINE: SCRIPTED})  # no rewriting: accepted


def test_sampler_gap_by_hand():
    gap = SamplerGap()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    gap.add(torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]]), torch.tensor([[-1.25, -1.0, 0.0], [-0.5, 0.0, 0.0]]), mask)
    gap.add(torch.tensor([[-3.0]]), torch.tensor([[-3.5]]), torch.ones(1, 1))
    m = gap.metrics()
    assert m["sampler_gap/mean"] == pytest.approx((0.25 + 1.0 + 0.0 + 0.5) / 4)
    assert m["sampler_gap/max"] == pytest.approx(1.0)
    assert SamplerGap().metrics() == {}
