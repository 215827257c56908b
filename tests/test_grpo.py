"""GRPO's advantages and loss against a hand computation in float64, and the micro-batch invariance."""

from __future__ import annotations

import math

import pytest
import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math
from tests.helpers import config, make_batch, policy_logp

LENGTHS = [3, 5, 1, 4, 2, 2, 5, 3]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]  # second group: all equal
G, W = 4, 5


def hand_advantages(rewards, G, eps=1e-4, unbiased=True):
    out = []
    for s in range(0, len(rewards), G):
        grp = rewards[s : s + G]
        mean = sum(grp) / G
        var = sum((r - mean) ** 2 for r in grp) / (G - 1 if unbiased else G)
        std = math.sqrt(var)
        out += [0.0 if std == 0 else (r - mean) / (std + eps) for r in grp]
    return out


def test_advantages_by_hand():
    batch = make_batch(LENGTHS, REWARDS, G, W)
    adv = GRPO(config()).advantages(batch, None)
    assert adv[4:].abs().max() == 0  # all-equal group -> A = 0
    torch.testing.assert_close(adv, torch.tensor(hand_advantages(REWARDS, G), dtype=torch.float64))
    pop = rl_math.group_advantages(batch.rewards, G, std="population")
    torch.testing.assert_close(pop, torch.tensor(hand_advantages(REWARDS, G, unbiased=False), dtype=torch.float64))
    none = rl_math.group_advantages(batch.rewards, G, std="none")
    torch.testing.assert_close(none[:4], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64))


def test_batch_scope_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv = rl_math.group_advantages(rewards, 4, std="unbiased", eps=0.0, scope="batch")
    means = torch.tensor([0.25] * 4 + [1.0] * 4, dtype=torch.float64)
    torch.testing.assert_close(adv, (rewards - means) / rewards.std())


def hand_grpo_loss(batch, logp, eps=0.2, beta=0.04):
    """-(1/G) sum_i 1/|o_i| sum_t [min(rho A, clip(rho) A) - beta k3], written out token by token."""
    adv = hand_advantages(batch.rewards.tolist(), batch.group_size)
    logp, old, ref, mask = logp.tolist(), batch.old_logp.tolist(), batch.ref_logp.tolist(), batch.mask.tolist()
    total = 0.0
    n = len(batch)
    for i in range(n):
        L = int(sum(mask[i]))
        row = 0.0
        for t in range(L):
            rho = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(rho, 1 - eps), 1 + eps)
            surr = min(rho * adv[i], clipped * adv[i])
            d = ref[i][t] - logp[i][t]
            k3 = math.exp(d) - d - 1
            row += surr - beta * k3
        total += row / L
    return -total / n


def test_loss_and_gradient_by_hand():
    batch = make_batch(LENGTHS, REWARDS, G, W)
    algo = GRPO(config())
    batch.advantages = algo.advantages(batch, None)
    logp = policy_logp(batch)
    norms = rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)
    out = algo.loss(logp, batch, norms)
    expected = hand_grpo_loss(batch, logp.detach())
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # some tokens clip and some do not, so both branches are exercised
    hi = out.stats["clip_frac_high"][0].item()
    lo = out.stats["clip_frac_low"][0].item()
    assert hi + lo > 0 and hi + lo < batch.mask.sum().item()
    # gradient: finite differences of the hand formula on a few active tokens
    out.loss.backward()
    for i, t in [(0, 0), (1, 4), (3, 2), (5, 1)]:
        h = 1e-6
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i, t] += h
        minus[i, t] -= h
        fd = (hand_grpo_loss(batch, plus) - hand_grpo_loss(batch, minus)) / (2 * h)
        assert logp.grad[i, t].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)
    assert logp.grad[2, 1:].abs().max() == 0  # masked tokens get no gradient


def test_on_policy_first_step_gradient_is_policy_gradient():
    """With l_old = sg[l] (mu = 1), rho = 1 and the gradient is A_i / (|o_i| N) per token (+ KL)."""
    batch = make_batch(LENGTHS, REWARDS, G, W)
    batch.old_logp = None
    algo = GRPO(config(**{"algo.beta": 0}))
    batch.advantages = algo.advantages(batch, None)
    logp = policy_logp(batch)
    algo.loss(logp, batch, rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)).loss.backward()
    expected = -(batch.advantages / batch.mask.sum(-1) / len(batch)).unsqueeze(1) * batch.mask
    torch.testing.assert_close(logp.grad, expected)


@pytest.mark.parametrize("aggregation", list(rl_math.AGGREGATIONS))
@pytest.mark.parametrize("split", [[8], [3, 5], [1, 2, 2, 3], [1] * 8])
def test_gradient_does_not_depend_on_micro_batch_split(aggregation, split):
    """Summing micro-batch shares (step-wide normalisers) gives the full batch's loss and gradient."""
    batch = make_batch(LENGTHS, REWARDS, G, W)
    algo = GRPO(config(**{"algo.aggregation": aggregation}))
    batch.advantages = algo.advantages(batch, None)
    norms = rl_math.StepNorms(len(batch), float(batch.mask.sum()), W)
    full_logp = policy_logp(batch)
    full = algo.loss(full_logp, batch, norms).loss
    full.backward()
    order = [6, 1, 4, 0, 7, 2, 5, 3]  # shuffled, as length-sorted micro-batches are
    leaf = policy_logp(batch)
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for size in split:
        rows = order[start : start + size]
        start += size
        mb = batch.select(rows)
        part = algo.loss(leaf[rows], mb, norms).loss
        part.backward()
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(leaf.grad, full_logp.grad, rtol=1e-12, atol=1e-14)


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    norms = rl_math.StepNorms(num_seqs=2, num_tokens=4, max_len=3)
    agg = lambda k: rl_math.aggregate(loss, mask, k, norms).item()  # noqa: E731
    assert agg("seq-mean-token-mean") == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert agg("token-mean") == pytest.approx(10 / 4)
    assert agg("seq-mean-token-sum-norm") == pytest.approx(10 / (2 * 3))
    assert agg("seq-mean-token-sum") == pytest.approx(10 / 2)
    assert agg("seq-sum-token-mean") == pytest.approx(6 / 3 + 4 / 1)


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    d = [-0.5, 1.0]
    torch.testing.assert_close(rl_math.kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0], dtype=torch.float64))
    torch.testing.assert_close(rl_math.kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5], dtype=torch.float64))
    torch.testing.assert_close(rl_math.kl_estimate(logp, ref, "k3"),
                               torch.tensor([math.exp(x) - x - 1 for x in d], dtype=torch.float64))


def test_dual_clip_by_hand():
    ratio = torch.tensor([5.0, 5.0, 0.5], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    s = rl_math.clipped_surrogate(ratio, adv, 0.2, 0.2, dual_clip=3.0)
    # A<0, rho=5: min(-5, -1.2) = -5, dual clip max(-5, -3) = -3; A>0: min(5, 1.2) = 1.2; A<0, rho=.5: min(-.5,-.8) = -.8
    torch.testing.assert_close(s.value, torch.tensor([-3.0, 1.2, -0.8], dtype=torch.float64))


def test_k3_clamps_the_log_ratio_and_is_exact_inside_the_clamp():
    """k3 = e^d - d - 1 with d = ref - logp clamped to [-20, 20]; d/dlogp k3 = 1 - e^d inside, 0 outside."""
    ref = torch.zeros(8, dtype=torch.float64)
    d = [1.0, -0.5, 2.78, 5.0, -15.0, 19.5, 50.0, -1000.0]  # the last two past the clamp (e^1000 is inf)
    logp = torch.tensor([-x for x in d], dtype=torch.float64, requires_grad=True)
    k3 = rl_math.kl_estimate(logp, ref, "k3")
    k3.sum().backward()
    inside = d[:6]
    want = [math.exp(x) - x - 1 for x in inside] + [math.exp(20) - 21, math.exp(-20) + 19]
    want_grad = [1 - math.exp(x) for x in inside] + [0.0, 0.0]
    torch.testing.assert_close(k3.detach(), torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=torch.float64))
    # float32, as the trainer computes it: a reference far above and far below the policy stays finite
    logp = torch.tensor([-1000.0, 1000.0], dtype=torch.float32, requires_grad=True)
    k3 = rl_math.kl_estimate(logp, torch.zeros(2), "k3")
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(logp.grad).all()
