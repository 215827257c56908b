"""mt-grpo and gigpo against float64 computations written out here, on hand-made multi-turn batches:
turn-level advantages (first turn Â^O + λ·Â^T, later turns Â^O, no environment result: Â^{T+O}); episode
plus anchor-state step advantages (groups across and within trajectories, singletons 0, γ-discounted
step returns, mean_norm and mean_std_norm, trajectory- or step-weighted episode statistics); the
token-mean clipped loss and its gradient, with environment tokens out of it."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from algos import ALGORITHMS
from algos.base import StepContext
from grpo.foundation import rl_math
from grpo.foundation.batch import Turn
from tests.helpers import config, make_batch, policy_logp

ENV = {"env.name": "calculator"}  # the multi-turn algorithms refuse a config without an environment

W = 12


def mt_batch(layouts, rewards, terms=None, group_size=3, seed=0):
    """``layouts[i]``: list of (start, end, obs_end, step reward, state) per turn."""
    lengths = [max(t[2] for t in lay) for lay in layouts]
    b = make_batch(lengths, rewards, group_size, W, seed=seed)
    mask = torch.zeros(len(layouts), W, dtype=torch.float64)
    for i, lay in enumerate(layouts):
        for s, e, *_ in lay:
            mask[i, s:e] = 1
    b.mask = mask
    b.old_logp, b.ref_logp, b.entropy = b.old_logp * mask, b.ref_logp * mask, b.entropy * mask
    b.turns = [[Turn(*t) for t in lay] for lay in layouts]
    if terms is not None:
        b.reward_terms = {k: torch.tensor(v, dtype=torch.float64) for k, v in terms.items()}
    return b


def norm(values, eps):
    """(x - mean) / (Bessel std + eps) within the list; all equal: 0."""
    m = statistics.fmean(values)
    if max(values) == min(values):
        return [0.0] * len(values)
    s = statistics.stdev(values)
    return [(v - m) / (s + eps) for v in values]


# ----------------------------------------------------------------------------- mt-grpo

CALL = [(0, 3, 7, 0.0, "q"), (7, 9, 9, 1.0, "t")]  # call, tool answer (masked), answer
DIRECT = [(0, 4, 4, 1.0, "q")]  # answered at once: no environment result


def test_mt_grpo_turn_level_advantages():
    layouts = [CALL, CALL, DIRECT, CALL, DIRECT, CALL]
    rt, ro = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0], [1.2, 0.2, 0.7, 0.0, 1.2, 0.2]
    b = mt_batch(layouts, [a + c for a, c in zip(rt, ro)], {"turn": rt, "outcome": ro})
    for lam in (1.0, 0.5):
        algo = ALGORITHMS.get("mt-grpo")(config("mt-grpo", **ENV, **{"algo.turn_coef": lam}))
        adv = algo.advantages(b, StepContext(algo.cfg, 0))
        expected = torch.zeros(6, W, dtype=torch.float64)
        for g in range(2):
            rows = range(3 * g, 3 * g + 3)
            at, ao = norm([rt[i] for i in rows], 1e-4), norm([ro[i] for i in rows], 1e-4)
            ato = norm([rt[i] + ro[i] for i in rows], 1e-4)
            for k, i in enumerate(rows):
                if layouts[i] is DIRECT:
                    expected[i, 0:4] = ato[k]
                else:
                    expected[i, 0:3] = ao[k] + lam * at[k]  # first turn, before the tool's answer
                    expected[i, 7:9] = ao[k]  # the answer turn; columns 3..6 are the tool's: 0
        assert torch.allclose(adv.double(), expected, atol=1e-12, rtol=0)


def test_mt_grpo_loss_and_gradient_are_the_token_mean_clipped_surrogate():
    layouts = [CALL, CALL, DIRECT, CALL, DIRECT, CALL]
    rt, ro = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0], [1.2, 0.2, 0.7, 0.0, 1.2, 0.2]
    b = mt_batch(layouts, [a + c for a, c in zip(rt, ro)], {"turn": rt, "outcome": ro})
    algo = ALGORITHMS.get("mt-grpo")(config("mt-grpo", **ENV))
    assert algo.a.aggregation == "token-mean" and algo.a.beta == 0 and algo.a.num_iterations == 2
    b.advantages = algo.advantages(b, StepContext(algo.cfg, 0))
    logp = policy_logp(b, spread=0.5)
    norms = rl_math.StepNorms(float(len(b)), float(b.mask.sum()), W)
    out = algo.loss(logp, b, norms)
    out.loss.backward()
    lp = logp.detach().clone().requires_grad_(True)
    total, count = 0.0, 0
    for i in range(6):
        for t in range(W):
            if b.mask[i, t] == 0:
                continue  # tool tokens and padding
            ratio = torch.exp(lp[i, t] - b.old_logp[i, t])
            a = b.advantages[i, t]
            total = total - torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            count += 1
    (total / count).backward()
    assert out.loss.item() == pytest.approx((total / count).item(), abs=1e-12)
    assert torch.allclose(logp.grad, lp.grad, atol=1e-12)
    assert (logp.grad[b.mask == 0] == 0).all()  # nothing flows through environment tokens


def test_mt_grpo_needs_multi_turn_batches_and_its_reward_terms():
    algo = ALGORITHMS.get("mt-grpo")(config("mt-grpo", **ENV))
    b = make_batch([3, 3], [1.0, 0.0], 2, W)
    with pytest.raises(ValueError, match="needs multi-turn rollouts: set env.name"):
        algo.advantages(b, StepContext(algo.cfg, 0))
    b = mt_batch([CALL] * 3, [1.0, 0.0, 1.0], {"env": [1.0, 0.0, 1.0]})
    with pytest.raises(ValueError, match="no reward term 'turn'"):
        algo.advantages(b, StepContext(algo.cfg, 0))


# ----------------------------------------------------------------------------- gigpo

# group 0: state "s1" recurs within trajectory 0 and across trajectories 0 and 2; "s0" (the start) is
# shared by all three; "s2" and "s3" are singletons. Group 1: every state a singleton but the start.
G0 = [
    [(0, 1, 3, -0.1, "s0"), (3, 4, 6, 0.0, "s1"), (6, 7, 7, 1.0, "s1")],
    [(0, 1, 3, 0.0, "s0"), (3, 4, 4, 1.0, "s2")],
    [(0, 1, 3, -0.1, "s0"), (3, 4, 6, -0.1, "s1"), (6, 7, 9, 0.0, "s3"), (9, 10, 10, 0.5, "s4")],
]
G1 = [
    [(0, 1, 3, 0.0, "x0"), (3, 4, 4, 1.0, "x1")],
    [(0, 1, 3, -0.1, "x0"), (3, 4, 6, 0.0, "x2"), (6, 7, 7, 0.0, "x3")],
    [(0, 1, 1, 1.0, "x0")],
]


def gigpo_expected(layouts, gamma, omega, kind, weighted):
    eps = 1e-6
    adv = torch.zeros(len(layouts), W, dtype=torch.float64)
    for g in range(len(layouts) // 3):
        rows = list(range(3 * g, 3 * g + 3))
        R = {i: sum(t[3] for t in layouts[i]) for i in rows}
        pool = [R[i] for i in rows for _ in (layouts[i] if weighted else [0])]  # step-weighted: R once per step
        m = statistics.fmean(pool)
        F = 1.0 if kind == "mean_norm" else statistics.stdev(pool) + eps
        a_e = {i: (R[i] - m) / F for i in rows}
        ret = {}
        for i in rows:
            rs = [t[3] for t in layouts[i]]
            for t in range(len(rs)):
                ret[i, t] = sum(gamma ** (k - t) * rs[k] for k in range(t, len(rs)))
        a_s = {}
        for i in rows:
            for t, turn in enumerate(layouts[i]):
                peers = [ret[j, u] for j in rows for u, other in enumerate(layouts[j]) if other[4] == turn[4]]
                if len(peers) == 1:
                    a_s[i, t] = 0.0
                else:
                    Fs = 1.0 if kind == "mean_norm" else statistics.stdev(peers) + eps
                    a_s[i, t] = (ret[i, t] - statistics.fmean(peers)) / Fs
        for i in rows:
            for t, (s, e, *_) in enumerate(layouts[i]):
                adv[i, s:e] = a_e[i] + omega * a_s[i, t]
    return adv


@pytest.mark.parametrize("kind", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("gamma,omega", [(0.95, 1.0), (0.5, 0.3)])
def test_gigpo_episode_and_anchor_state_advantages(kind, weighted, gamma, omega):
    layouts = G0 + G1
    b = mt_batch(layouts, [sum(t[3] for t in lay) for lay in layouts])
    algo = ALGORITHMS.get("gigpo")(config("gigpo", **ENV, **{"algo.norm": kind, "algo.gamma": gamma, "algo.step_coef": omega,
                                                     "algo.episode_stats": "step" if weighted else "trajectory"}))
    ctx = StepContext(algo.cfg, 0)
    adv = algo.advantages(b, ctx)
    expected = gigpo_expected(layouts, gamma, omega, kind, weighted)
    assert torch.allclose(adv.double(), expected, atol=1e-12, rtol=0)
    # anchor groups: s0, s1 (3 members each: across and within trajectories), x0 (3); singletons: s2 s3 s4 x1 x2 x3
    assert ctx.metrics["gigpo/anchor_groups"] == 3 and ctx.metrics["gigpo/singleton_frac"] == pytest.approx(6 / 15)


def test_gigpo_singletons_give_only_the_episode_advantage_and_returns_are_discounted():
    algo = ALGORITHMS.get("gigpo")(config("gigpo", **ENV))
    assert (algo.opt.gamma, algo.opt.step_coef, algo.opt.norm, algo.a.beta) == (0.95, 1.0, "mean_norm", 0.01)
    layouts = G1 + G1
    b = mt_batch(layouts, [sum(t[3] for t in lay) for lay in layouts])
    a_e, a_s, _ = algo.step_advantages(b)
    R = [1.0, -0.1, 1.0]
    assert a_e[:3] == pytest.approx([r - statistics.fmean(R) for r in R], abs=1e-12)
    # x0 is shared: returns 0.95 * 1, -0.1 + 0, 1.0 -> centred; every other state is a singleton: 0
    x0 = [0.95, -0.1, 1.0]
    assert [a_s[0][0], a_s[1][0], a_s[2][0]] == pytest.approx([x - statistics.fmean(x0) for x in x0], abs=1e-12)
    assert a_s[0][1] == 0 and a_s[1][1:] == [0.0, 0.0]
    from algos.gigpo import discounted_returns

    assert discounted_returns([-0.1, 0.0, 1.0], 0.95) == pytest.approx([-0.1 + 0.95**2, 0.95, 1.0])


def test_gigpo_loss_masks_observations_and_adds_the_k3_kl():
    layouts = G0 + G1
    b = mt_batch(layouts, [sum(t[3] for t in lay) for lay in layouts])
    algo = ALGORITHMS.get("gigpo")(config("gigpo", **ENV))
    b.advantages = algo.advantages(b, StepContext(algo.cfg, 0))
    logp = policy_logp(b, spread=0.5)
    out = algo.loss(logp, b, rl_math.StepNorms(float(len(b)), float(b.mask.sum()), W))
    total, count = 0.0, 0
    for i in range(len(b)):
        for t in range(W):
            if b.mask[i, t]:
                ratio = math.exp(logp[i, t].item() - b.old_logp[i, t].item())
                a = b.advantages[i, t].item()
                d = b.ref_logp[i, t].item() - logp[i, t].item()
                total += -(min(ratio * a, min(max(ratio, 0.8), 1.2) * a) - 0.01 * (math.exp(d) - d - 1))
                count += 1
    assert out.loss.item() == pytest.approx(total / count, abs=1e-12)
