"""The losses and advantages that TRL and verl ship (cispo, sapo, bnpo, luspo, vespo, ...) against float64
computations written plainly here, from the peers' definitions (docs/algorithms.md names each source).

Everything runs in float64 on a ragged batch whose padding holds garbage (so a missing mask shows),
with an all-equal reward group, and ratios inside and beyond the clip ranges; loss and gradient must
agree to 1e-6 relative, and micro-batch shares must add up to the whole step.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config
from tests.test_algos_losses import (LENGTHS, REWARDS, WIDTH, assert_split_invariant, make_batch, policy_logp,
                                     ref_group_adv, run_algo)

N = len(LENGTHS)
TOL = 1e-6
# per-row log-ratio offsets: rows far beyond any clip range (e^2 = 7.4, e^-1.5 = 0.22) next to rows near 1
OFFSETS = [0.0, 2.0, -1.5, 0.05, 0.0, 1.0, -0.5, 0.0, 0.1, -2.0, 1.8, 0.0]


def batch64(seed: int = 0):
    """make_batch in float64, with garbage in the padding of every per-token tensor."""
    b = make_batch(seed=seed)
    pad = 1 - b.mask.double()
    b.mask = b.mask.double()
    b.rewards = b.rewards.double()
    b.old_logp = b.old_logp.double() - 7.0 * pad
    b.ref_logp = b.ref_logp.double() + 3.0 * pad
    b.entropy = b.entropy.double() + 9.0 * pad
    return b


def logp64(b, scale: float = 0.3, offsets=OFFSETS):
    lp = policy_logp(b, scale=scale, offsets=offsets).double()
    return lp + 5.0 * (1 - b.mask)  # garbage in the padding


def leaf(logp):
    return logp.detach().clone().requires_grad_(True)


def check(loss, grad, x, expected):
    """loss and d loss / d logp equal the float64 reference ``expected`` (a function of leaf x) to 1e-6."""
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=TOL, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=TOL, atol=1e-12)


def run(name, b, logp, **options):
    adv, loss, grad, algo, batch, out, ctx = run_algo(name, b, logp, **options)
    return adv, loss, grad, algo, batch, out


def grpo_adv(rewards=REWARDS):
    return ref_group_adv(rewards)


def test_fixture_ratios_cover_every_regime():
    b = batch64()
    r = torch.exp(logp64(b) - b.old_logp)[b.mask.bool()]
    assert (r > 5).any() and (r < 0.8).any() and ((r > 0.8) & (r < 1.2)).any() and (r < 0.25).any()


# --------------------------------------------------------------------------- cispo


@pytest.mark.parametrize("lower_clip", [False, True])
def test_cispo(lower_clip):
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run("cispo", b, logp, lower_clip=lower_clip)
    torch.testing.assert_close(adv, grpo_adv(), rtol=TOL, atol=1e-12)
    x = leaf(logp)
    total, tokens = 0.0, 0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            w = math.exp(float(logp[i, t]) - float(b.old_logp[i, t]))
            w = min(w, 5.0)  # TRL: clamp(coef_1, max=epsilon_high = 5)
            if lower_clip:
                w = max(w, 0.8)  # verl: clamp(ratio, 1 - 0.2, 1 + eps_high)
            total = total + w * float(adv[i]) * x[i, t]
            tokens += 1
    check(loss, grad, x, -total / tokens)
    assert float(out.stats["clip_frac_high"][0]) > 0
    assert (float(out.stats["clip_frac_low"][0]) > 0) == lower_clip
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- sapo


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo(tau_pos, tau_neg):
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run("sapo", b, logp, tau_pos=tau_pos, tau_neg=tau_neg)
    x = leaf(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        a = float(adv[i])
        tau = tau_pos if a > 0 else tau_neg
        s = 0.0
        for t in range(L):
            r = torch.exp(x[i, t] - float(b.old_logp[i, t]))
            s = s + torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        total = total + s / L
    check(loss, grad, x, -total / N)
    assert_split_invariant(algo, batch, logp)


def test_sapo_on_policy_gradient_is_grpos():
    """f'(1) = 1: with pi = pi_old the gate's gradient is GRPO's (no KL, same aggregation)."""
    b = batch64()
    logp = b.old_logp.clone()
    *_, grad_s, _, _, _ = run("sapo", batch64(), logp)
    *_, grad_g, _, _, _ = run("grpo", batch64(), logp, beta=0)
    torch.testing.assert_close(grad_s, grad_g, rtol=1e-12, atol=1e-15)


def test_sapo_rejects_a_non_positive_temperature():
    with pytest.raises(ConfigError, match="tau_neg"):
        load_config(None, "sapo", ["algo.tau_neg=0"])


# --------------------------------------------------------------------------- bnpo


def test_bnpo_is_token_mean_grpo_over_the_whole_step():
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run("bnpo", b, logp)
    x = leaf(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            r = torch.exp(x[i, t] - float(b.old_logp[i, t]))
            a = float(adv[i])
            total = total + torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    check(loss, grad, x, -total / sum(LENGTHS))
    # TRL's bnpo on one local batch holding the whole step is the same number
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- luspo


def test_luspo_scales_gspo_by_length():
    b = batch64()
    logp = logp64(b, scale=2e-4, offsets=[1e-4, -2e-3, 3e-3, 2e-3, 0.0, 1e-3, -1e-3, 0.0, -3e-3, 2e-3, 1e-4, -1e-4])
    adv, loss, grad, algo, batch, out = run("luspo", b, logp)
    x = leaf(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = torch.exp(sum(x[i, t] - float(b.old_logp[i, t]) for t in range(L)) / L)
        a = float(adv[i])
        total = total + L * torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a)
    check(loss, grad, x, -total / N)  # TRL: (per_seq_loss * |o_i|).mean()
    assert float(out.stats["clip_frac_low"][0]) > 0 and float(out.stats["clip_frac_high"][0]) > 0
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- vespo


def vespo_phi(log_w: float, a: float, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0) -> float:
    k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
    w = math.exp(log_w)
    return math.exp(lam) * w ** k * math.exp(-lam * w)


def test_vespo():
    b = batch64()
    logp = logp64(b, scale=0.1, offsets=[o / 4 for o in OFFSETS])
    adv, loss, grad, algo, batch, out = run("vespo", b, logp)
    x = leaf(logp)
    total, phis = 0.0, []
    for i, L in enumerate(LENGTHS):
        log_w = sum(min(max(float(logp[i, t]) - float(b.old_logp[i, t]), -20), 20) for t in range(L))
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        phi = vespo_phi(log_w, float(adv[i]))
        phis.append(phi)
        total = total + sum(phi * float(adv[i]) * x[i, t] for t in range(L))
    check(loss, grad, x, -total / sum(LENGTHS))
    assert max(phis) > 1.0 and min(phis) < 0.5  # the weight acts both ways
    assert vespo_phi(0.0, 1.0) == pytest.approx(1.0) and vespo_phi(0.0, -1.0) == pytest.approx(1.0)
    assert_split_invariant(algo, batch, logp)


def test_vespo_weight_underflows_to_zero_not_nan():
    b = batch64()
    logp = b.old_logp + 30.0 * b.mask  # log w clamped at 20: phi = e^(lam + 20 k - lam e^20) = 0
    adv, loss, grad, *_ = run("vespo", b, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() == 0


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["cispo", "sapo", "bnpo", "luspo", "vespo", "rloo", "reinforce-pp",
                                  "reinforce-pp-baseline", "opo", "grpo-passk", "gdpo", "remax", "clip-cov",
                                  "kl-cov", "geo-mean", "dppo-tv", "dppo-kl"])
def test_preset_loads_and_names_its_algorithm(name):
    cfg = load_config(f"configs/{name}.yaml")
    assert cfg.algo.name == name and cfg.data.source == "builtin"


# --------------------------------------------------------------------------- advantage estimators (verl)

REWARDS2 = [0.2, 0.9, 0.5, 0.1, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.3, 0.3]  # group 1 all-equal


def ppo_token_mean(x, b, adv_at):
    """-sum_i sum_t min(r A, clip(r, 0.8, 1.2) A) / sum |o|, A = adv_at(i, t) (verl's vanilla loss, token-mean)."""
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            r = torch.exp(x[i, t] - float(b.old_logp[i, t]))
            a = adv_at(i, t)
            total = total + torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    return -total / sum(LENGTHS)


def groups(values):
    return [values[g:g + 4] for g in range(0, len(values), 4)]


def check_estimator(name, rewards, adv_at, **options):
    b = batch64()
    b.rewards = torch.tensor(rewards, dtype=torch.float64)
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run(name, b, logp, **options)
    x = leaf(logp)
    check(loss, grad, x, ppo_token_mean(x, b, adv_at))
    assert_split_invariant(algo, batch, logp)
    return adv


@pytest.mark.parametrize("rewards", [REWARDS, REWARDS2])
def test_rloo_leave_one_out(rewards):
    want = []
    for g in groups(rewards):
        want += [r - (sum(g) - r) / 3 for r in g]
    adv = check_estimator("rloo", rewards, lambda i, t: want[i])
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-12)
    assert (adv[4:8] == 0).all()


def token_whiten(values):
    """values[i][t] on row i's tokens -> (v - mean) / sqrt(var + 1e-8), mean and unbiased var over all tokens."""
    flat = [v for row in values for v in row]
    mu = sum(flat) / len(flat)
    var = sum((v - mu) ** 2 for v in flat) / (len(flat) - 1)
    return [[(v - mu) / math.sqrt(var + 1e-8) for v in row] for row in values]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp(gamma):
    returns = [[REWARDS2[i] * gamma ** (L - 1 - t) for t in range(L)] for i, L in enumerate(LENGTHS)]
    want = token_whiten(returns)
    adv = check_estimator("reinforce-pp", REWARDS2, lambda i, t: want[i][t], gamma=gamma)
    for i, L in enumerate(LENGTHS):
        torch.testing.assert_close(adv[i, :L], torch.tensor(want[i], dtype=torch.float64), rtol=TOL, atol=1e-12)
        assert (adv[i, L:] == 0).all()


def test_reinforce_pp_with_kl_in_reward():
    b = batch64()
    coef = 0.1
    k1 = [[float(b.old_logp[i, t] - b.ref_logp[i, t]) for t in range(L)] for i, L in enumerate(LENGTHS)]
    rewards = [[(REWARDS2[i] if t == L - 1 else 0.0) - coef * k1[i][t] for t in range(L)]
               for i, L in enumerate(LENGTHS)]
    returns = [[sum(row[t:]) for t in range(len(row))] for row in rewards]
    want = token_whiten(returns)
    adv = check_estimator("reinforce-pp", REWARDS2, lambda i, t: want[i][t], kl_in_reward=coef)
    for i, L in enumerate(LENGTHS):
        torch.testing.assert_close(adv[i, :L], torch.tensor(want[i], dtype=torch.float64), rtol=TOL, atol=1e-12)
    algo = run("reinforce-pp", batch64(), logp64(batch64()), kl_in_reward=coef)[3]
    assert algo.needs_reference and algo.needs_old_logprobs and not algo.a.beta


def test_reinforce_pp_baseline():
    centred = []
    for g in groups(REWARDS2):
        centred += [r - sum(g) / 4 for r in g]
    want = token_whiten([[centred[i]] * L for i, L in enumerate(LENGTHS)])
    adv = check_estimator("reinforce-pp-baseline", REWARDS2, lambda i, t: want[i][t])
    for i, L in enumerate(LENGTHS):
        torch.testing.assert_close(adv[i, :L], torch.tensor(want[i], dtype=torch.float64), rtol=TOL, atol=1e-12)


def test_opo_length_weighted_baseline():
    want = []
    for g0 in range(0, N, 4):
        rs, ls = REWARDS2[g0:g0 + 4], LENGTHS[g0:g0 + 4]
        b = sum(r * L for r, L in zip(rs, ls)) / sum(ls)
        want += [r - b for r in rs]
    adv = check_estimator("opo", REWARDS2, lambda i, t: want[i])
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-12)


def otb_batch(rewards):
    """batch64 with sum_v pi^2 per token from the old-policy pass (in [pi^2, 1]), garbage in the padding."""
    b = batch64()
    b.rewards = torch.tensor(rewards, dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    pi = b.old_logp.exp()
    sq = pi ** 2 + (1 - pi ** 2) * torch.rand(b.mask.shape, generator=g, dtype=torch.float64) * 0.5
    b.extra = {**b.extra, "sum_pi_squared": sq * b.mask + 5.0 * (1 - b.mask)}
    return b


def otb_plain(b, rewards, zero_tail=True, kl=None):
    """verl's optimal token baseline, written out: returns-to-go G, energies W = cumulative 1 - 2 pi + sum pi^2,
    B_t = sum_j G W / (sum_j W + 1e-8) over the group's rows that reach t, A = G - B."""
    rows = []
    for i, L in enumerate(LENGTHS):
        r = [0.0] * L
        r[L - 1] = rewards[i]
        if kl is not None:
            r = [r[t] - kl(i, t) for t in range(L)]
        G = [sum(r[t:]) for t in range(L)]
        W, acc = [], 0.0
        for t in range(L):
            acc += 1 - 2 * math.exp(float(b.old_logp[i, t])) + float(b.extra["sum_pi_squared"][i, t])
            W.append(acc)
        rows.append((G, W))
    adv = {}
    for g0 in range(0, N, 4):
        members = list(range(g0, g0 + 4))
        lens = sorted((LENGTHS[i] for i in members), reverse=True)
        for i in members:
            for t in range(LENGTHS[i]):
                reach = [j for j in members if t < LENGTHS[j]]
                base = sum(rows[j][0][t] * rows[j][1][t] for j in reach) / (sum(rows[j][1][t] for j in reach) + 1e-8)
                if zero_tail and LENGTHS[i] == lens[0] and lens[0] > lens[1] and t >= lens[1]:
                    base = 0.0
                adv[i, t] = rows[i][0][t] - base
    return adv


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("rewards", [REWARDS, REWARDS2])
def test_optimal_token_baseline(rewards, zero_tail):
    b = otb_batch(rewards)
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run("optimal-token-baseline", b, logp, zero_tail=zero_tail)
    want = otb_plain(b, rewards, zero_tail)
    assert algo.needs_old_logprobs and algo.needs_sum_pi_squared
    for i, L in enumerate(LENGTHS):
        for t in range(adv.shape[1]):
            assert float(adv[i, t]) == pytest.approx(want[i, t] if t < L else 0.0, rel=TOL, abs=1e-12), (i, t)
    if zero_tail:  # the longest row of each group learns its full return beyond the second-longest
        assert float(adv[1, 4]) == pytest.approx(rewards[1], abs=1e-12)
    x = leaf(logp)
    check(loss, grad, x, ppo_token_mean(x, b, lambda i, t: want[i, t]))
    assert_split_invariant(algo, batch, logp)


def test_optimal_token_baseline_with_kl_in_reward():
    b = otb_batch(REWARDS2)
    logp = logp64(b)
    coef = 0.1
    adv = run("optimal-token-baseline", b, logp, kl_in_reward=coef)[0]
    want = otb_plain(b, REWARDS2, kl=lambda i, t: coef * float(b.old_logp[i, t] - b.ref_logp[i, t]))
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            assert float(adv[i, t]) == pytest.approx(want[i, t], rel=TOL, abs=1e-12)


def test_optimal_token_baseline_refuses_multi_turn():
    with pytest.raises(ConfigError, match="env.name"):
        load_config(None, "optimal-token-baseline", ["env.name=calculator", "data.source=env"])


@pytest.mark.parametrize("rewards", [REWARDS, REWARDS2])
def test_grpo_passk_only_the_best_learns(rewards):
    want = [0.0] * N
    for g0 in range(0, N, 4):
        rs = rewards[g0:g0 + 4]
        order = sorted(range(4), key=lambda j: -rs[j])
        mean = sum(rs) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / 3)
        want[g0 + order[0]] = (rs[order[0]] - rs[order[1]]) / (std + 1e-6)
    adv = check_estimator("grpo-passk", rewards, lambda i, t: want[i])
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-12)
    assert (adv != 0).sum() <= N // 4


def test_kl_in_reward_turns_the_score_into_r_minus_kl():
    b = batch64()
    coef = 0.05
    scores = [REWARDS2[i] - coef * sum(float(b.old_logp[i, t] - b.ref_logp[i, t]) for t in range(L))
              for i, L in enumerate(LENGTHS)]
    want = []
    for g in groups(scores):
        want += [s - (sum(g) - s) / 3 for s in g]
    check_estimator("rloo", REWARDS2, lambda i, t: want[i], kl_in_reward=coef)
    b.rewards = torch.tensor(REWARDS2, dtype=torch.float64)
    adv = run("grpo", b, logp64(b), kl_in_reward=coef)[0]
    torch.testing.assert_close(adv, ref_group_adv(scores), rtol=TOL, atol=1e-12)


def test_kl_in_reward_must_be_non_negative():
    with pytest.raises(ConfigError, match="algo.kl_in_reward=-0.1"):
        load_config(None, "rloo", ["algo.kl_in_reward=-0.1"])


def test_kl_in_reward_is_refused_where_it_does_not_apply_and_names_where_it_does():
    with pytest.raises(ConfigError, match="does not apply to gtpo") as e:
        load_config(None, "gtpo", ["algo.kl_in_reward=0.1"])
    assert "rloo" in str(e.value) and "reinforce-pp" in str(e.value) and "gtpo" not in str(e.value).split("(")[-1]
    with pytest.raises(ConfigError, match="does not apply to cppo"):  # cppo's advantages precede the forward passes
        load_config(None, "cppo", ["algo.kl_in_reward=0.1"])


# --------------------------------------------------------------------------- gdpo


def test_gdpo_normalises_each_reward_function_in_its_group():
    from algos import ALGORITHMS
    from algos.base import StepContext
    from tests.test_algos_losses import norms_of

    cfg = load_config(None, "gdpo", [f"rollout.max_completion_length={WIDTH}",
                                     "rewards=[{fn: digits_match, weight: 1.0}, {fn: digits_match, weight: 0.5}, "
                                     "{fn: format_reward, weight: 2.0}]"])
    algo = ALGORITHMS.get("gdpo")(cfg)
    b = batch64()
    terms = {"digits_match": REWARDS, "digits_match_2": REWARDS2,
             "format_reward": [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]}
    b.reward_terms = {k: torch.tensor(v, dtype=torch.float32) for k, v in terms.items()}
    adv = algo.advantages(b, StepContext(cfg, 0))
    weights = {"digits_match": 1.0, "digits_match_2": 0.5, "format_reward": 2.0}
    total = [0.0] * N
    for k, vals in terms.items():
        for g0 in range(0, N, 4):
            rs = [float(torch.tensor(v, dtype=torch.float32)) for v in vals[g0:g0 + 4]]
            mean = sum(rs) / 4
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / 3)
            for j in range(4):
                total[g0 + j] += weights[k] * (rs[j] - mean) / (std + 1e-4)
    mean = sum(total) / N
    std = math.sqrt(sum((s - mean) ** 2 for s in total) / (N - 1))
    want = [(s - mean) / (std + 1e-4) for s in total]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-9)
    assert (adv[4:8] != 0).any()  # a group all-equal in one function still differs in another
    b.advantages = adv
    logp = logp64(b)
    assert_split_invariant(algo, b, logp)
    assert norms_of(b).num_seqs == N


def test_gdpo_leaves_rows_a_function_skipped_out_of_its_group_statistics():
    """None (nan) rows: TRL's nanmean / unbiased nanstd per group, 0 contribution; < 2 scored rows: 0."""
    from algos import ALGORITHMS
    from algos.base import StepContext

    cfg = load_config(None, "gdpo", [f"rollout.max_completion_length={WIDTH}",
                                     "rewards=[{fn: digits_match, weight: 1.0}, {fn: format_reward, weight: 0.5}]"])
    nan = float("nan")
    # group 0: 3 scored; group 1: 1 scored (-> 0); group 2: none scored (-> 0)
    code = [0.9, nan, 0.3, 0.0, nan, 1.0, nan, nan, nan, nan, nan, nan]
    fmt = [1.0, 0.0, 1.0, 1.0, 0.2, 0.7, 0.7, 0.1, 0.0, 1.0, 0.5, 0.5]
    b = batch64()
    b.reward_terms = {"digits_match": torch.tensor(code, dtype=torch.float64),
                      "format_reward": torch.tensor(fmt, dtype=torch.float64)}
    adv = ALGORITHMS.get("gdpo")(cfg).advantages(b, StepContext(cfg, 0))
    total = [0.0] * N
    for vals, w in ((code, 1.0), (fmt, 0.5)):
        for g0 in range(0, N, 4):
            rs = [v for v in vals[g0:g0 + 4] if not math.isnan(v)]
            if len(rs) < 2:
                continue
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
            for j in range(4):
                if not math.isnan(vals[g0 + j]):
                    total[g0 + j] += w * (vals[g0 + j] - mean) / (std + 1e-4)
    mean = sum(total) / N
    std = math.sqrt(sum((s - mean) ** 2 for s in total) / (N - 1))
    want = [(s - mean) / (std + 1e-4) for s in total]
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_gdpo_names_the_missing_reward_function():
    from algos import ALGORITHMS
    from algos.base import StepContext

    cfg = load_config(None, "gdpo", [])
    b = batch64()
    b.reward_terms = {"other": b.rewards}
    with pytest.raises(RuntimeError, match="digits_match"):
        ALGORITHMS.get("gdpo")(cfg).advantages(b, StepContext(cfg, 0))


# --------------------------------------------------------------------------- remax


class GreedyRollout:
    """The rollout service's narrow surface remax uses: a greedy completion per prompt, scored by a rule."""

    def __init__(self, reward_of_prompt):
        self.reward_of_prompt, self.calls = reward_of_prompt, []

    class params:  # noqa: N801 - mirrors RolloutService.params (a property)
        @staticmethod
        def greedy():
            return "greedy"

    def generate(self, prompts, params, n):
        from grpo.rollout.engine import Completions

        self.calls.append((len(prompts), params, n))
        return Completions(tokens=[[7, 8]] * len(prompts), truncated=torch.zeros(len(prompts), dtype=torch.bool))

    def decode(self, tokens):
        return ["g"] * len(tokens)

    def score(self, batch):
        batch.rewards = torch.tensor([self.reward_of_prompt[p] for p in batch.prompt_index], dtype=torch.float32)


def test_remax_subtracts_the_greedy_reward():
    from algos import ALGORITHMS
    from algos.base import StepContext

    cfg = load_config(None, "remax", [f"rollout.max_completion_length={WIDTH}"])
    algo = ALGORITHMS.get("remax")(cfg)
    b = batch64()
    b.rewards = torch.tensor(REWARDS2, dtype=torch.float64)
    greedy = {0: 0.5, 1: 1.0, 2: 0.0}
    rollout = GreedyRollout(greedy)
    ctx = StepContext(cfg, 0, rollout=rollout)
    b = algo.process_batch(b, ctx)
    assert rollout.calls == [(3, "greedy", 1)]
    adv = algo.advantages(b, ctx)
    want = [REWARDS2[i] - greedy[i // 4] for i in range(N)]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-12)
    b.advantages = adv
    logp = logp64(b)
    x = leaf(logp)
    lp = logp.clone().requires_grad_(True)
    from tests.test_algos_losses import norms_of

    loss = algo.loss(lp, b, norms_of(b)).loss
    loss.backward()
    check(loss.detach(), lp.grad, x, ppo_token_mean(x, b, lambda i, t: want[i]))
    assert_split_invariant(algo, b, logp)


def test_remax_with_kl_in_reward_is_verls_reward_to_go_minus_the_baseline():
    """Issue 42, item 19: with KL in the reward, verl's remax advantage is a per-token reward-to-go of
    (r - c k1) minus the greedy baseline (core_algos.compute_remax_outcome_advantage); ours gave every token
    s_i - b."""
    from algos import ALGORITHMS
    from algos.base import StepContext

    coef = 0.1
    cfg = load_config(None, "remax", [f"rollout.max_completion_length={WIDTH}", f"algo.kl_in_reward={coef}"])
    algo = ALGORITHMS.get("remax")(cfg)
    b = batch64()
    b.rewards = torch.tensor(REWARDS2, dtype=torch.float64)
    greedy = {0: 0.5, 1: 1.0, 2: 0.0}
    ctx = StepContext(cfg, 0, rollout=GreedyRollout(greedy))
    b = algo.process_batch(b, ctx)
    adv = algo.advantages(b, ctx)
    for i, L in enumerate(LENGTHS):
        rewards = [(REWARDS2[i] if t == L - 1 else 0.0) - coef * float(b.old_logp[i, t] - b.ref_logp[i, t])
                   for t in range(L)]
        want = [sum(rewards[t:]) - greedy[i // 4] for t in range(L)]
        torch.testing.assert_close(adv[i, :L], torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-12)
        assert (adv[i, L:] == 0).all()


# --------------------------------------------------------------------------- verl policy losses


def plain_cov(b, adv):
    """cov_t = (A - mean A)(l_old - mean l_old) over the valid tokens, as nested lists."""
    toks = [(i, t) for i, L in enumerate(LENGTHS) for t in range(L)]
    ma = sum(float(adv[i]) for i, _ in toks) / len(toks)
    ml = sum(float(b.old_logp[i, t]) for i, t in toks) / len(toks)
    return {(i, t): (float(adv[i]) - ma) * (float(b.old_logp[i, t]) - ml) for i, t in toks}


def test_kl_cov_penalises_the_top_covariance_tokens():
    b = batch64()
    logp = logp64(b)
    ratio = 0.1  # 0.1 of 40 tokens: the top 4
    adv, loss, grad, algo, batch, out = run("kl-cov", b, logp, cov_ratio=ratio, kl_coef=0.7)
    cov = plain_cov(b, adv)
    top = set(sorted(cov, key=lambda k: -cov[k])[:int(sum(LENGTHS) * ratio)])
    got = {(i, t) for i, L in enumerate(LENGTHS) for t in range(L) if batch.extra["cov_top"][i, t]}
    assert got == top and len(top) == 4
    x = leaf(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            d = x[i, t] - float(b.old_logp[i, t])
            total = total - torch.exp(d) * float(adv[i]) + (0.7 * d.abs() if (i, t) in top else 0.0)
    check(loss, grad, x, total / sum(LENGTHS))
    assert_split_invariant(algo, batch, logp)


def test_clip_cov_drops_random_candidates_from_the_gradient():
    b = batch64()
    b.rewards = torch.tensor(REWARDS2, dtype=torch.float64)
    logp = logp64(b)
    lb, ub, ratio = 0.05, 3.0, 0.1
    adv, loss, grad, algo, batch, out = run("clip-cov", b, logp, cov_ratio=ratio, cov_lb=lb, cov_ub=ub)
    cov = plain_cov(b, adv)
    candidates = {k for k, c in cov.items() if lb < c < ub}
    dropped = {(i, t) for i, L in enumerate(LENGTHS) for t in range(L) if batch.extra["cov_drop"][i, t]}
    assert len(candidates) > 4 and dropped <= candidates and len(dropped) == int(sum(LENGTHS) * ratio)
    x = leaf(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            if (i, t) in dropped:
                continue
            r = torch.exp(x[i, t] - float(b.old_logp[i, t]))
            a = float(adv[i])
            total = total + torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    check(loss, grad, x, -total / sum(LENGTHS))
    assert_split_invariant(algo, batch, logp)
    b2 = batch64()
    b2.rewards = torch.tensor(REWARDS2, dtype=torch.float64)
    again = run("clip-cov", b2, logp, cov_ratio=ratio, cov_lb=lb, cov_ub=ub)[4]  # same seed and step
    assert torch.equal(again.extra["cov_drop"], batch.extra["cov_drop"])


def test_cov_options_are_validated():
    with pytest.raises(ConfigError, match="cov_ratio"):
        load_config(None, "kl-cov", ["algo.cov_ratio=0"])
    with pytest.raises(ConfigError, match="cov_lb"):
        load_config(None, "clip-cov", ["algo.cov_lb=5", "algo.cov_ub=1"])


@pytest.mark.parametrize("dro_beta", [0.05, 2.0])
def test_dro_is_reinforce_with_a_quadratic_log_ratio_penalty(dro_beta):
    """verl's loss_mode=dro: token-mean of -(A log pi - dro_beta / 2 (log pi - log pi_old)^2), no clip."""
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run("dro", b, logp, dro_beta=dro_beta)
    want_adv = ref_group_adv(REWARDS)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=TOL, atol=1e-12)
    x = leaf(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            d = x[i, t] - float(b.old_logp[i, t])
            total = total - (want_adv[i] * x[i, t] - 0.5 * dro_beta * d * d)
    check(loss, grad, x, total / sum(LENGTHS))
    assert_split_invariant(algo, batch, logp)


@pytest.mark.parametrize("override", [[], ["algo.dro_beta=0"], ["algo.dro_beta=-1"]])
def test_dro_beta_is_required_and_positive(override):
    with pytest.raises(ConfigError, match="algo.dro_beta"):
        load_config(None, "dro", override)


def test_geo_mean_matches_verls_gmpo():
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out = run("geo-mean", b, logp)
    x = leaf(logp)
    # verl's compute_policy_loss_geo_mean, tensor-wise in float64 (its 1e-8 in the length)
    m = b.mask
    d = x - b.old_logp
    sgn = torch.sign(adv).unsqueeze(-1)
    d_clamp = torch.clamp(d, -0.4, 0.4)
    d_min = sgn * torch.min(sgn * d, sgn * d_clamp)
    ratio = torch.exp((d_min * m).sum(-1) / (m.sum(-1) + 1e-8))
    a_seq = (adv.unsqueeze(-1) * m).sum(-1) / (m.sum(-1) + 1e-8)
    check(loss, grad, x, torch.mean(-a_seq * ratio))
    assert float(out.stats["clip_frac_low"][0]) > 0 and float(out.stats["clip_frac_high"][0]) > 0
    assert_split_invariant(algo, batch, logp)


@pytest.mark.parametrize("name", ["dppo-tv", "dppo-kl"])
def test_dppo_masks_tokens_whose_probability_moved_too_far(name):
    b = batch64()
    logp = logp64(b, scale=0.3, offsets=[o / 2 for o in OFFSETS])
    logp = torch.where(b.mask.bool(), logp.clamp(max=-0.01), logp)  # probabilities stay below 1
    adv, loss, grad, algo, batch, out = run(name, b, logp)
    x = leaf(logp)
    total, masked = 0.0, 0
    for i, L in enumerate(LENGTHS):
        a = float(adv[i])
        for t in range(L):
            lp, lo = float(logp[i, t]), float(b.old_logp[i, t])
            p, q = math.exp(lp), math.exp(lo)
            if name == "dppo-tv":
                valid = (p - q <= 0.15) if a > 0 else (p - q >= -0.15)
            else:
                kl = q * (lo - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                valid = (kl <= 0.05 or p <= q) if a > 0 else (kl <= 0.05 or p >= q)
            masked += not valid
            w = min(math.exp(lp - lo), 20.0)
            total = total + (-a * w * x[i, t] if valid else 0.0)
    check(loss, grad, x, total / sum(LENGTHS))
    assert masked > 0
    assert_split_invariant(algo, batch, logp)


def test_dppo_ratio_cap_must_exceed_one():
    with pytest.raises(ConfigError, match="ratio_cap"):
        load_config(None, "dppo-tv", ["algo.ratio_cap=0.5"])


# --------------------------------------------------------------------------- options for any loss (TRL)


def run_prepared(name, b, logp, **options):
    """As the trainer: process_batch, advantages, prepare_loss (the whole-batch options), loss."""
    from algos import ALGORITHMS
    from algos.base import StepContext
    from tests.test_algos_losses import make_cfg, norms_of

    cfg = make_cfg(name, **options)
    algo = ALGORITHMS.get(name)(cfg)
    ctx = StepContext(cfg, 0)
    b = algo.process_batch(b, ctx)
    b.advantages = algo.advantages(b, ctx)
    b = algo.prepare_loss(b, ctx)
    lp = logp.clone().requires_grad_(True)
    out = algo.loss(lp, b, norms_of(b))
    out.loss.backward()
    return b.advantages.detach(), out.loss.detach(), lp.grad, algo, b, out, ctx


def grpo_plain(x, b, adv, beta=0.0, keep=lambda i, t: True, cap=None, kl_weight=lambda i, t: 1.0):
    """GRPO's seq-mean-token-mean loss in plain loops, with a per-token keep mask on the policy-gradient
    term, an optional delta cap on the unclipped ratio and a per-token weight on the k3 KL."""
    total = 0.0
    for i in range(N):
        L = int(b.mask[i].sum())
        s = 0.0
        for t in range(L):
            r = torch.exp(x[i, t] - float(b.old_logp[i, t]))
            a = float(adv[i])
            if keep(i, t):
                unclipped = r if cap is None else torch.clamp(r, max=cap)
                s = s + torch.minimum(unclipped * a, r.clamp(0.8, 1.2) * a)
            if beta:
                d = float(b.ref_logp[i, t]) - x[i, t]
                s = s - beta * kl_weight(i, t) * (torch.exp(d) - d - 1)
        total = total + (s / L if L else 0.0)
    return -total / N


def test_delta_caps_the_unclipped_ratio():
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out, _ = run_prepared("grpo", b, logp, beta=0, delta=1.5)
    x = leaf(logp)
    check(loss, grad, x, grpo_plain(x, b, adv, cap=1.5))
    r = torch.exp(logp - b.old_logp)[b.mask.bool()]
    assert (r > 1.5).any()  # the cap binds where A < 0
    assert_split_invariant(algo, batch, logp)


def test_off_policy_sequence_mask():
    b = batch64()
    logp = logp64(b)
    thr = 0.05
    adv, loss, grad, algo, batch, out, _ = run_prepared("grpo", b, logp, beta=0, off_policy_mask_threshold=thr)
    kept = []
    for i, L in enumerate(LENGTHS):
        kl = sum(float(b.old_logp[i, t] - logp[i, t]) for t in range(L)) / L
        kept.append(float(adv[i]) >= 0 or kl <= thr)
    assert not all(kept) and any(kept)
    x = leaf(logp)
    check(loss, grad, x, grpo_plain(x, b, adv, keep=lambda i, t: kept[i]))
    assert_split_invariant(algo, batch, logp)


def test_off_policy_mask_measures_against_the_sampler_when_there_is_one():
    b = batch64()
    logp = logp64(b)
    b.sampler_logp = logp.clone()  # the sampler's log-probs equal the current policy's: no sequence is off-policy
    adv, loss, grad, *_ = run_prepared("grpo", b, logp, beta=0, off_policy_mask_threshold=0.0)
    x = leaf(logp)
    check(loss, grad, x, grpo_plain(x, b, adv))


def quantile(values, q):
    """torch.quantile's linear interpolation, written out."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_top_entropy_quantile_keeps_the_high_entropy_tokens():
    b = batch64()
    logp = logp64(b)
    rho = 0.3
    adv, loss, grad, algo, batch, out, ctx = run_prepared("grpo", b, logp, beta=0, top_entropy_quantile=rho)
    assert algo.needs_entropy
    ents = [float(b.entropy[i, t]) for i, L in enumerate(LENGTHS) for t in range(L)]
    thr = quantile(ents, 1 - rho)
    keep = lambda i, t: float(b.entropy[i, t]) >= thr  # noqa: E731
    assert sum(keep(i, t) for i, L in enumerate(LENGTHS) for t in range(L)) == sum(e >= thr for e in ents) < 20
    x = leaf(logp)
    check(loss, grad, x, grpo_plain(x, b, adv, keep=keep))
    assert ctx.metrics["entropy_mask/kept_frac"] == pytest.approx(sum(e >= thr for e in ents) / len(ents))
    assert_split_invariant(algo, batch, logp)


def test_bias_corrected_kl_is_weighted_by_the_ratio():
    b = batch64()
    logp = logp64(b)
    adv, loss, grad, algo, batch, out, _ = run_prepared("grpo", b, logp, use_bias_correction_kl=True)
    x = leaf(logp)
    check(loss, grad, x, grpo_plain(x, b, adv, beta=0.04,
                                    kl_weight=lambda i, t: torch.exp(x[i, t] - float(b.old_logp[i, t]))))
    assert_split_invariant(algo, batch, logp)


def test_mask_truncated_completions_leaves_them_out_of_loss_and_normaliser():
    b = batch64()
    truncated = [i in (1, 6, 10) for i in range(N)]
    b.truncated = torch.tensor(truncated)
    logp = logp64(b)
    adv, loss, grad, algo, batch, out, _ = run_prepared("bnpo", b, logp, mask_truncated_completions=True)
    assert batch.mask[[1, 6, 10]].sum() == 0
    x = leaf(logp)
    total, tokens = 0.0, 0
    for i, L in enumerate(LENGTHS):
        if truncated[i]:
            continue
        for t in range(L):
            r = torch.exp(x[i, t] - float(b.old_logp[i, t]))
            a = float(adv[i])
            total, tokens = total + torch.minimum(r * a, r.clamp(0.8, 1.2) * a), tokens + 1
    check(loss, grad, x, -total / tokens)
    assert grad[[1, 6, 10]].abs().sum() == 0


def test_scale_rewards_batch_is_adv_scope_batch():
    """TRL's scale_rewards="batch": (r - group mean) / (std over the whole batch + 1e-4) (unbiased std)."""
    b = batch64()
    b.rewards = torch.tensor(REWARDS2, dtype=torch.float64)
    adv = run_prepared("grpo", b, logp64(b), adv_scope="batch")[0]
    mean = sum(REWARDS2) / N
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS2) / (N - 1))
    want = []
    for g in groups(REWARDS2):
        want += [0.0 if max(g) == min(g) else (r - sum(g) / 4) / (std + 1e-4) for r in g]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=TOL, atol=1e-12)


def entropy64(b):
    """A current-policy entropy per token (a leaf with its gradient), with garbage in the padding."""
    g = torch.Generator().manual_seed(5)
    ent = torch.rand(b.mask.shape, generator=g, dtype=torch.float64) * 2 + 9.0 * (1 - b.mask.double())
    return ent.requires_grad_(True)


@pytest.mark.parametrize("name,aggregation", [("grpo", None), ("cispo", None), ("gspo", "token-mean")])
def test_entropy_bonus_subtracts_alpha_times_the_aggregated_entropy(name, aggregation):
    """algo.entropy_coef: loss = the algorithm's loss - alpha * aggregate(H), aggregated as the loss; the
    gradient reaches H (the current policy's entropy) with -alpha / (N L_i) per token (seq-mean-token-mean) or
    -alpha / (tokens of the step) (token-mean); micro-batch shares add up to the whole step."""
    from algos import ALGORITHMS
    from tests.test_algos_losses import make_cfg, norms_of

    b = batch64()
    logp = logp64(b)
    alpha = 0.03
    options = {"entropy_coef": alpha, **({"aggregation": aggregation} if aggregation else {})}
    cfg = make_cfg(name, **options)
    algo = ALGORITHMS.get(name)(cfg)
    assert algo.entropy_bonus and not algo.needs_entropy  # a fixed coefficient needs no old-policy pass
    b.advantages = algo.advantages(b, None)
    norms = norms_of(b)
    ent = entropy64(b)
    lp = logp.clone().requires_grad_(True)
    out = algo.loss_with_bonus(lp, ent, b, norms)
    out.loss.backward()
    lp0 = logp.clone().requires_grad_(True)
    plain = algo.loss(lp0, b, norms)  # without the bonus
    plain.loss.backward()
    agg = cfg.algo.aggregation
    tokens = sum(LENGTHS)
    bonus = 0.0
    want_grad = torch.zeros_like(ent)
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            w = 1.0 / (N * L) if agg == "seq-mean-token-mean" else 1.0 / tokens
            bonus += w * float(ent.detach()[i, t])
            want_grad[i, t] = -alpha * w
    assert agg == ("token-mean" if name in ("cispo", "gspo") else "seq-mean-token-mean")
    assert float(out.loss.detach()) == pytest.approx(float(plain.loss.detach()) - alpha * bonus, rel=TOL, abs=1e-12)
    torch.testing.assert_close(ent.grad, want_grad, rtol=TOL, atol=1e-15)
    torch.testing.assert_close(lp.grad, lp0.grad, rtol=TOL, atol=1e-15)  # the policy term is untouched
    stat = out.stats["entropy_bonus/entropy"]
    assert float(stat[0] / stat[1]) == pytest.approx(sum(float(ent.detach()[i, t]) for i, L in enumerate(LENGTHS)
                                                         for t in range(L)) / tokens, rel=TOL)
    total, grad = 0.0, torch.zeros_like(ent)
    for part in [[0, 5, 7, 11], [1, 2, 3], [4, 6, 8, 9, 10]]:
        e = ent.detach()[part].clone().requires_grad_(True)
        share = algo.loss_with_bonus(logp[part].clone().requires_grad_(True), e, b.select(part), norms)
        share.loss.backward()
        total += float(share.loss.detach())
        grad[part] += e.grad
    assert total == pytest.approx(float(out.loss.detach()), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, ent.grad, rtol=1e-9, atol=1e-15)


def test_adaptive_entropy_coefficient_follows_skywork_or1():
    """algo.entropy_target: alpha_k = c_k while the step's token-mean entropy e_k is below the target (else 0),
    then c_{k+1} = c_k +- delta, clipped to [min, max]; c_0 = algo.entropy_coef. The entropy is the old policy's
    (needs_entropy), its mean over every valid token; the coefficient is checkpointed."""
    from algos import ALGORITHMS
    from algos.base import StepContext
    from tests.test_algos_losses import make_cfg

    cfg = make_cfg("grpo", entropy_coef=0.001, entropy_target=0.5, entropy_coef_delta=0.002,
                   entropy_coef_min=0.0005, entropy_coef_max=0.004)
    algo = ALGORITHMS.get("grpo")(cfg)
    assert algo.entropy_bonus and algo.needs_entropy
    means = [0.3, 0.2, 0.45, 0.1, 0.7, 0.5, 0.6, 0.6, 0.2]
    c, alphas, cs = 0.001, [], []
    for e in means:  # the rule, written out
        alphas.append(c if e < 0.5 else 0.0)
        c = min(max(c + (0.002 if e < 0.5 else -0.002), 0.0005), 0.004)
        cs.append(c)
    got, got_c = [], []
    for k, e in enumerate(means):
        b = batch64()
        b.advantages = algo.advantages(b, None)
        # padding garbage must not count: only the valid tokens' mean is e
        b.entropy = e * b.mask.double() + 9.0 * (1 - b.mask.double())
        ctx = StepContext(cfg, k)
        algo.prepare_loss(b, ctx)
        got.append(ctx.metrics["entropy_bonus/coef"])
        got_c.append(algo.entropy_c)
    assert got == pytest.approx(alphas, abs=1e-15) and got_c == pytest.approx(cs, abs=1e-15)
    assert 0.004 in got_c and 0.0005 in got_c  # both bounds were reached
    again = ALGORITHMS.get("grpo")(cfg)
    again.load_options_state_dict(algo.options_state_dict())
    assert again.entropy_c == algo.entropy_c


@pytest.mark.parametrize("overrides,match", [
    (["algo.entropy_coef=-0.1"], "algo.entropy_coef=-0.1 is invalid: it must be >= 0"),
    (["algo.entropy_coef_delta=0.01"], "algo.entropy_target"),
    (["algo.entropy_coef_max=0.1"], "algo.entropy_target"),
    (["algo.entropy_target=0"], "algo.entropy_target=0.0 is invalid: it must be > 0"),
    (["algo.entropy_target=0.2", "algo.entropy_coef_delta=0"], "algo.entropy_coef_delta"),
    (["algo.entropy_target=0.2", "algo.entropy_coef_min=0.1"], "<= algo.entropy_coef_max"),
])
def test_entropy_bonus_options_are_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, "grpo", overrides)


@pytest.mark.parametrize("algo,override,match", [
    ("grpo", "algo.delta=1.1", "must be > 1 \\+ algo.clip_eps_high"),
    ("cispo", "algo.delta=4", "cispo has no ratio clip"),
    ("grpo", "algo.top_entropy_quantile=1.5", r"\[0, 1\]"),
    ("gspo", "algo.top_entropy_quantile=0.2", "sequence-level"),
    ("vespo", "algo.off_policy_mask_threshold=0.1", "sequence-level"),
    ("grpo", "algo.off_policy_mask_threshold=-1", ">= 0"),
    ("dapo", "algo.use_bias_correction_kl=true", "algo.beta > 0"),
])
def test_loss_options_are_validated(algo, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, algo, [override])


def test_list_algos_names_every_algorithm_with_its_paper_and_one_line(capsys):
    """``python train.py --list-algos`` (its entry, in this process: it returns before anything starts): one block
    per registered algorithm, headed by its name, its paper and its tag, then its one-line summary."""
    import train
    from algos import ALGORITHMS

    assert train.main(["--list-algos"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = {line.split()[0]: k for k, line in enumerate(out) if line and not line[0].isspace()}
    assert sorted(heads) == sorted(ALGORITHMS)
    for name, cls in ALGORITHMS.items():
        assert cls.paper and cls.summary and "\n" not in cls.summary, name
        assert cls.tag in ("paper", "code", "unverified", "peer"), (name, cls.tag)
        k = heads[name]
        assert out[k].split(None, 1)[1] == f"{cls.paper}  [{cls.tag}]", out[k]
        assert out[k + 1].strip() == cls.summary
        assert out[k + 2].strip().startswith("knobs:")
    for name in ("cispo", "sapo", "bnpo", "luspo", "vespo", "clip-cov", "kl-cov", "geo-mean", "rloo",
                 "reinforce-pp", "reinforce-pp-baseline", "remax", "opo", "optimal-token-baseline", "grpo-passk",
                 "gdpo", "dppo-tv", "dppo-kl", "dro"):
        assert ALGORITHMS[name].tag == "peer", name  # the peers' algorithms, as docs/algorithms.md tags them
