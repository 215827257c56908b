"""The loss family (drgrpo, gtpo, grpo-s, gspo, gspo-token, tic-grpo, pspo, lambda-grpo, grpo-lambda,
grpo-lead, diver, grpo-ps, and grpo itself) against independent float64 computations.

Every reference below is written plainly from docs/algorithms.md (or TRL's documented formulas) with
Python loops over completions and tokens; gradients of the references come from autograd on those
float64 loops. The batches are hand-made: ragged lengths, an all-equal group, positive and negative
advantages, ratios inside and outside the clip range.
"""

from __future__ import annotations

import math

import pytest
import torch

from algos import ALGORITHMS
from algos.base import StepContext
from grpo.foundation import rl_math
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import ConfigError
from grpo.training.configure import load_config

G = 4
LENGTHS = [3, 5, 2, 4, 4, 4, 1, 5, 2, 3, 5, 3]  # ragged, three groups of four
REWARDS = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # group 1 is all-equal
WIDTH = 6  # L_max = max_completion_length (larger than every length: Dr. GRPO's constant matters)


# --------------------------------------------------------------------------- helpers


def make_cfg(name: str, **options):
    overrides = [f"algo.{k}={v}" for k, v in options.items()] + [f"rollout.max_completion_length={WIDTH}"]
    return load_config(None, name, overrides)


def make_batch(lengths=LENGTHS, rewards=REWARDS, ids=None, texts=None, seed: int = 0, width: int = WIDTH) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = torch.zeros(n, width)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
    if ids is None:  # rows of a group share some prefixes (lambda-GRPO's prefix tree)
        ids = [[5 + (i % 2), 9, 10 + (i % 3)] + [20 + i + t for t in range(3, L)] for i, L in enumerate(lengths)]
        ids = [row[:L] for row, L in zip(ids, lengths)]
    return RolloutBatch(
        prompt_ids=[[1, 2]] * n,
        completion_ids=ids,
        mask=mask,
        truncated=torch.zeros(n, dtype=torch.bool),
        group_size=G,
        prompt_index=[i // G for i in range(n)],
        items=[{"prompt": "p", "answer": "47"} for _ in range(n)],
        prompt_text=["p"] * n,
        completion_text=texts if texts is not None else [f"c{i}" for i in range(n)],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        old_logp=(-0.1 - 2.5 * torch.rand(n, width, generator=g)) * mask,
        ref_logp=(-0.1 - 2.5 * torch.rand(n, width, generator=g)) * mask,
        entropy=(0.05 + 2.0 * torch.rand(n, width, generator=g)) * mask,
    )


def policy_logp(batch: RolloutBatch, scale: float = 0.3, seed: int = 1, offsets=None) -> torch.Tensor:
    """Current log-probs = old + noise (ratios both inside and outside the clip range)."""
    g = torch.Generator().manual_seed(seed)
    delta = scale * torch.randn(batch.old_logp.shape, generator=g)
    if offsets is not None:
        delta = delta + torch.tensor(offsets).unsqueeze(-1)
    return ((batch.old_logp + delta) * batch.mask).float()


def norms_of(batch: RolloutBatch) -> rl_math.StepNorms:
    return rl_math.StepNorms(num_seqs=float(len(batch)), num_tokens=float(batch.mask.sum()), max_len=WIDTH)


def run_algo(name: str, batch: RolloutBatch, logp: torch.Tensor, step: int = 0, **options):
    """advantages, loss value, d loss / d logp, the algorithm, the processed batch."""
    cfg = make_cfg(name, **options)
    algo = ALGORITHMS.get(name)(cfg)
    ctx = StepContext(cfg, step)
    batch = algo.process_batch(batch, ctx)
    batch.advantages = algo.advantages(batch, ctx)
    lp = logp.clone().requires_grad_(True)
    out = algo.loss(lp, batch, norms_of(batch))
    out.loss.backward()
    return batch.advantages.detach().double(), out.loss.detach().double(), lp.grad.double(), algo, batch, out, ctx


def assert_split_invariant(algo, batch: RolloutBatch, logp: torch.Tensor) -> None:
    """Micro-batch shares with the step's normalisers add up to the whole step's loss and gradient."""
    norms = norms_of(batch)
    whole = logp.clone().requires_grad_(True)
    algo.loss(whole, batch, norms).loss.backward()
    rows = [[0, 5, 7, 11], [1, 2, 3], [4, 6, 8, 9, 10]]
    total, grad = 0.0, torch.zeros_like(logp, dtype=torch.float64)
    for part in rows:
        lp = logp[part].clone().requires_grad_(True)
        out = algo.loss(lp, batch.select(part), norms)
        out.loss.backward()
        total += float(out.loss.detach())
        grad[part] += lp.grad.double()
    whole_loss = float(algo.loss(logp, batch, norms).loss)
    assert total == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, whole.grad.double(), rtol=1e-5, atol=1e-7)


def ref_group_adv(rewards, std: str = "unbiased", eps: float = 1e-4):
    out = []
    for g0 in range(0, len(rewards), G):
        grp = [float(r) for r in rewards[g0 : g0 + G]]
        mean = sum(grp) / G
        if max(grp) == min(grp):
            out += [0.0] * G
            continue
        if std == "none":
            out += [r - mean for r in grp]
            continue
        var = sum((r - mean) ** 2 for r in grp) / (G - 1 if std == "unbiased" else G)
        out += [(r - mean) / (math.sqrt(var) + eps) for r in grp]
    return torch.tensor(out, dtype=torch.float64)


def lp64(logp: torch.Tensor) -> torch.Tensor:
    return logp.detach().double().requires_grad_(True)


def clip_min(ratio, adv, lo, hi):
    """min(ratio A, clip(ratio, lo, hi) A) for float64 scalars, written out."""
    clipped = torch.clamp(ratio, lo, hi)
    return torch.minimum(ratio * adv, clipped * adv)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * 1e-1)


def assert_loss_and_grad(loss, grad, x, expected):
    """The algorithm's loss and d loss / d logp equal ``expected`` (a float64 function of leaf ``x``) and its gradient."""
    expected.backward()
    close(loss, expected.detach())
    close(grad, x.grad)


def test_fixture_has_clipped_and_unclipped_tokens_and_both_signs():
    batch = make_batch()
    ratio = torch.exp(policy_logp(batch) - batch.old_logp)[batch.mask.bool()]
    assert ((ratio > 1.2) | (ratio < 0.8)).any() and ((ratio < 1.2) & (ratio > 0.8)).any()
    adv = ref_group_adv(REWARDS)
    assert (adv > 0).any() and (adv < 0).any() and (adv[4:8] == 0).all()


# --------------------------------------------------------------------------- grpo / drgrpo vs TRL


def trl_loss(logp, old, ref, mask, adv, eps_low, eps_high, beta, loss_type, max_completion_length=WIDTH):
    """TRL GRPOTrainer's documented loss (docs/source/grpo_trainer.md, "Loss Types"), written tensor-wise
    the way TRL names things: coef_1 = exp(logp - old), coef_2 = clamp(coef_1, 1-eps, 1+eps_high),
    per_token_loss = -min(coef_1 A, coef_2 A) + beta * (exp(ref - logp) - (ref - logp) - 1)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    if beta:
        per_token_loss = per_token_loss + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":  # -1/G sum_i 1/|o_i| sum_t l_it
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":  # -1/(L G) sum_i sum_t l_it, L = max_completion_length
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    raise ValueError(loss_type)


def trl_advantages(rewards, scale_rewards: bool):
    """TRL: mean/std over each group of num_generations (torch.std: unbiased), + 1e-4 as TRL's code."""
    r = rewards.double().view(-1, G)
    mean = r.mean(1, keepdim=True)
    adv = r - mean
    if scale_rewards:
        adv = adv / (r.std(1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def test_grpo_matches_trl_grpo_loss_type():
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("grpo", batch, logp)
    close(adv, ref_group_adv(REWARDS))
    close(adv, trl_advantages(batch.rewards, True))
    x = lp64(logp)
    m = batch.mask.double()
    expected = trl_loss(x, batch.old_logp.double(), batch.ref_logp.double(), m, adv, 0.2, 0.2, 0.04, "grpo")
    assert_loss_and_grad(loss, grad, x, expected)
    assert float(out.stats["clip_frac_low"][0]) > 0 and float(out.stats["clip_frac_high"][0]) > 0
    assert "kl" in out.stats
    assert_split_invariant(algo, batch, logp)


def test_grpo_loss_plain_loops():
    """The same GRPO loss once more, written as plain per-token loops (DeepSeekMath eq. 3)."""
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, *_ = run_algo("grpo", batch, logp)
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = 0.0
        for t in range(L):
            rho = torch.exp(x[i, t] - float(batch.old_logp[i, t]))
            d = float(batch.ref_logp[i, t]) - x[i, t]
            s = s + clip_min(rho, float(adv[i]), 0.8, 1.2) - 0.04 * (torch.exp(d) - d - 1)
        total = total + s / L
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)


def test_drgrpo_matches_trl_dr_grpo_loss_type():
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("drgrpo", batch, logp)
    close(adv, ref_group_adv(REWARDS, std="none"))
    close(adv, trl_advantages(batch.rewards, False))  # TRL scale_rewards="none"
    assert algo.a.beta == 0 and not algo.needs_reference
    x = lp64(logp)
    expected = trl_loss(x, batch.old_logp.double(), None, batch.mask.double(), adv, 0.2, 0.2, 0.0, "dr_grpo")
    assert_loss_and_grad(loss, grad, x, expected)
    # plain: sum over all tokens / (N * L_max), no 1/|o_i|
    total = sum(
        clip_min(torch.exp(torch.tensor(float(logp[i, t] - batch.old_logp[i, t]), dtype=torch.float64)), float(adv[i]), 0.8, 1.2)
        for i, L in enumerate(LENGTHS) for t in range(L)
    )
    close(loss, -total / (len(LENGTHS) * WIDTH))
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- gspo / gspo-token

GSPO_OFFSETS = [1e-4, -2e-3, 3e-3, 2e-3, 0.0, 1e-3, -1e-3, 0.0, -3e-3, 2e-3, 1e-4, -1e-4]


def gspo_logp(batch):
    """Sequence mean log-ratios around the clip range 3e-4 / 4e-4: some sequences clipped, some not."""
    return policy_logp(batch, scale=2e-4, offsets=GSPO_OFFSETS)


def test_gspo_matches_trl_sequence_importance_sampling():
    batch = make_batch()
    logp = gspo_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("gspo", batch, logp)
    close(adv, ref_group_adv(REWARDS))
    # TRL importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0
    x = lp64(logp)
    m = batch.mask.double()
    log_ratio = x - batch.old_logp.double()
    log_importance_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - 3e-4, 1 + 4e-4)
    per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    expected = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    assert_loss_and_grad(loss, grad, x, expected)
    n_low, n_high = float(out.stats["clip_frac_low"][0]), float(out.stats["clip_frac_high"][0])
    assert n_low > 0 and n_high > 0 and n_low + n_high < 8  # clipped and unclipped sequences
    assert_split_invariant(algo, batch, logp)


def test_gspo_plain_loops():
    batch = make_batch()
    logp = gspo_logp(batch)
    adv, loss, grad, *_ = run_algo("gspo", batch, logp)
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        mean_delta = sum(x[i, t] - float(batch.old_logp[i, t]) for t in range(L)) / L
        total = total + clip_min(torch.exp(mean_delta), float(adv[i]), 1 - 3e-4, 1 + 4e-4)
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)


def test_gspo_token_equals_gspo_when_advantages_are_per_sequence():
    batch = make_batch()
    logp = gspo_logp(batch)
    _, loss_s, grad_s, *_ = run_algo("gspo", make_batch(), logp)
    adv_t, loss_t, grad_t, algo, batch_t, *_ = run_algo("gspo-token", batch, logp)
    close(loss_t, loss_s, tol=1e-6)
    close(grad_t, grad_s, tol=1e-6)
    assert grad_s.abs().sum() > 0
    # explicitly with A_{i,t} = A_i given as a [rows, T] tensor
    batch_t.advantages = adv_t.float().unsqueeze(-1).expand(-1, WIDTH) * batch_t.mask
    lp = logp.clone().requires_grad_(True)
    out = algo.loss(lp, batch_t, norms_of(batch_t))
    out.loss.backward()
    close(out.loss.detach(), loss_s, tol=1e-6)
    close(lp.grad, grad_s, tol=1e-6)
    assert_split_invariant(algo, batch_t, logp)


def test_sequence_level_loss_adds_token_kl_when_beta_is_positive():
    """gspo with beta > 0: the sequence surrogate plus beta * k3 KL averaged per sequence, then over sequences."""
    batch = make_batch()
    logp = gspo_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("gspo", batch, logp, beta=0.04)
    assert algo.needs_reference and "kl" in out.stats
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        mean_delta = sum(x[i, t] - float(batch.old_logp[i, t]) for t in range(L)) / L
        kl = 0.0
        for t in range(L):
            d = float(batch.ref_logp[i, t]) - x[i, t]
            kl = kl + torch.exp(d) - d - 1
        total = total + clip_min(torch.exp(mean_delta), float(adv[i]), 1 - 3e-4, 1 + 4e-4) - 0.04 * kl / L
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- tic-grpo


@pytest.mark.parametrize("upper_only,length_corrected", [(False, False), (True, False), (False, True)])
def test_tic_grpo(upper_only, length_corrected):
    batch = make_batch()
    logp = policy_logp(batch, scale=0.1)
    adv, loss, grad, algo, batch, out, _ = run_algo(
        "tic-grpo", batch, logp, upper_only_clip=upper_only, length_corrected=length_corrected)
    close(adv, ref_group_adv(REWARDS))
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = sum(x[i, t] - float(batch.old_logp[i, t]) for t in range(L))
        w = torch.exp(torch.clamp(s, -20.0, 20.0))
        a = float(adv[i])
        if upper_only:
            term = torch.minimum(w * a, torch.minimum(w, torch.tensor(1.2, dtype=torch.float64)) * a)
        else:
            term = clip_min(w, a, 0.8, 1.2)
        total = total + (term / L if length_corrected else term)
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert_split_invariant(algo, batch, logp)


def test_tic_grpo_clamps_the_log_ratio_at_20():
    batch = make_batch()
    logp = policy_logp(batch, scale=0.0, offsets=[6.0] + [0.0] * 11)  # row 0: sum Delta = 18 ... 30
    logp[0, :3] = batch.old_logp[0, :3] + 8.0  # sum = 24 > 20
    _, loss, grad, *_ = run_algo("tic-grpo", batch, logp)
    assert torch.isfinite(loss) and (grad[0] == 0).all()  # clamped (and clipped: A_0 > 0)


# --------------------------------------------------------------------------- pspo


def test_pspo_defaults_follow_the_authors_runs():
    """alpha 0.1, token-mean, beta 0, mu 2, group-std advantages: class defaults and the preset."""
    for cfg in (make_cfg("pspo"), load_config("configs/pspo.yaml")):
        a = cfg.algo
        assert (a.options.alpha, a.aggregation, a.beta, a.num_iterations) == (0.1, "token-mean", 0.0, 2)
        assert (a.adv_std, a.adv_scope) == ("unbiased", "group")
    assert ALGORITHMS.get("pspo").tag == "code"


def test_pspo_with_its_defaults_against_plain_loops():
    """Token-mean over the step's tokens, beta = 0: -sum_i sum_t ((1 - a) rho + a) A_i / sum_i |o_i|."""
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("pspo", batch, logp)
    close(adv, ref_group_adv(REWARDS))
    assert "kl" not in out.stats
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            rho = torch.exp(x[i, t] - float(batch.old_logp[i, t]))
            total = total + (0.9 * rho + 0.1) * float(adv[i])
    expected = -total / sum(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert_split_invariant(algo, batch, logp)


def test_pspo_against_plain_loops():
    """With a KL term and the GRPO paper's aggregation, passed explicitly (the defaults are token-mean, beta 0)."""
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("pspo", batch, logp, beta=0.04, aggregation="seq-mean-token-mean")
    close(adv, ref_group_adv(REWARDS))
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = 0.0
        for t in range(L):
            rho = torch.exp(x[i, t] - float(batch.old_logp[i, t]))
            d = float(batch.ref_logp[i, t]) - x[i, t]
            s = s + (0.9 * rho + 0.1) * float(adv[i]) - 0.04 * (torch.exp(d) - d - 1)
        total = total + s / L
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert_split_invariant(algo, batch, logp)


def test_pspo_alpha_zero_equals_unclipped_grpo():
    batch = make_batch()
    logp = policy_logp(batch)
    _, loss_p, grad_p, *_ = run_algo("pspo", batch, logp, alpha=0.0, beta=0.04, aggregation="seq-mean-token-mean")
    # GRPO whose clip never binds (the ratios here lie in (0.3, 3))
    _, loss_g, grad_g, _, _, out, _ = run_algo("grpo", make_batch(), logp, clip_eps_low=0.9, clip_eps_high=100.0)
    assert float(out.stats["clip_frac_low"][0]) == 0 and float(out.stats["clip_frac_high"][0]) == 0
    close(loss_p, loss_g, tol=1e-6)
    close(grad_p, grad_g, tol=1e-6)


def test_pspo_rejects_alpha_outside_unit_interval():
    with pytest.raises(ConfigError, match=r"algo\.alpha"):
        make_cfg("pspo", alpha=1.5)


# --------------------------------------------------------------------------- lambda-grpo


def test_lambda_grpo_prefix_counts_and_loss():
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, _ = run_algo("lambda-grpo", batch, logp)
    ids = batch.completion_ids
    counts = [[0.0] * WIDTH for _ in LENGTHS]
    for i, L in enumerate(LENGTHS):
        g0 = (i // G) * G
        for t in range(L):
            counts[i][t] = sum(1 for j in range(g0, g0 + G) if len(ids[j]) > t and ids[j][: t + 1] == ids[i][: t + 1])
    assert max(max(c) for c in counts) > 1  # prefixes are shared
    close(batch.extra["prefix_count"] * batch.mask, torch.tensor(counts))
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = 0.0
        for t in range(L):
            rho = torch.exp(x[i, t] - float(batch.old_logp[i, t]))
            d = float(batch.ref_logp[i, t]) - x[i, t]
            s = s + (clip_min(rho, float(adv[i]), 0.8, 1.2) - 0.04 * (torch.exp(d) - d - 1)) / counts[i][t]
        total = total + s / L
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert_split_invariant(algo, batch, logp)


def test_lambda_grpo_counts_duplicates():
    ids = [[7, 8, 9], [7, 8, 9], [7, 8, 2], [1, 8, 9]]
    c = rl_math.prefix_counts(ids, 4, 3)
    assert c.tolist() == [[3, 3, 2], [3, 3, 2], [3, 3, 1], [1, 1, 1]]


# --------------------------------------------------------------------------- grpo-lambda


@pytest.mark.parametrize("trace", ["recent", "both"])
def test_grpo_lambda(trace):
    batch = make_batch()
    logp = policy_logp(batch, scale=0.1)
    adv, loss, grad, algo, batch, out, _ = run_algo("grpo-lambda", batch, logp, trace=trace, lam=0.9, gamma=0.95)
    expected_adv = ref_group_adv(REWARDS).clamp(min=-0.1)
    close(adv, expected_adv)
    assert ((adv + 0.1).abs() < 1e-7).any() and (adv > 0).any()
    decay = 0.9 * 0.95
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = 0.0
        for t in range(L):
            log_rho = 0.0
            for k in range(t + 1):  # 1-based k' = k + 1: (gamma lambda)^(k'-1) = decay^k
                w = decay ** (t - k) if trace == "recent" else max(decay ** (t - k), decay ** k)
                log_rho = log_rho + w * (x[i, k] - float(batch.old_logp[i, k]))
            d = float(batch.ref_logp[i, t]) - x[i, t]
            s = s + clip_min(torch.exp(log_rho), float(adv[i]), 0.8, 1.2) - 0.04 * (torch.exp(d) - d - 1)
        total = total + s / L
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert_split_invariant(algo, batch, logp)


def test_grpo_lambda_on_policy_gradient_carries_the_trace():
    """On-policy (rho~ = 1), the gradient on token k is A * sum_{t >= k} decay^(t-k) / (N |o_i|)."""
    batch = make_batch()
    logp = policy_logp(batch)
    batch.old_logp = None
    adv, loss, grad, *_ = run_algo("grpo-lambda", batch, logp, beta=0.0)
    decay = 0.99
    for i, L in enumerate(LENGTHS):
        for k in range(L):
            expected = -float(adv[i]) * sum(decay ** (t - k) for t in range(k, L)) / (L * len(LENGTHS))
            assert float(grad[i, k]) == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_grpo_lambda_validates_lambda():
    with pytest.raises(ConfigError, match=r"algo\.lam"):
        make_cfg("grpo-lambda", lam=1.5)


# --------------------------------------------------------------------------- gtpo


def gtpo_reference(batch, alpha1=1.0, alpha2=0.1, scope="batch"):
    """Shaped token rewards and advantages of GTPO, written out per group and position."""
    n_rows = len(LENGTHS)
    H = batch.entropy.double().tolist()
    pos = [[0.0] * WIDTH for _ in range(n_rows)]
    neg = [[0.0] * WIDTH for _ in range(n_rows)]
    for g0 in range(0, n_rows, G):
        rows = range(g0, g0 + G)
        plus = [i for i in rows if REWARDS[i] >= 1.0]
        minus = [i for i in rows if REWARDS[i] < 1.0]
        for t in range(WIDTH):
            act_p = [k for k in plus if LENGTHS[k] > t]
            act_m = [k for k in minus if LENGTHS[k] > t]
            for i in act_p:
                pos[i][t] = alpha1 * REWARDS[i] + alpha2 * H[i][t] / sum(H[k][t] for k in act_p) * len(act_p)
            for j in act_m:
                inv = 1.0 / max(H[j][t], 1e-6)
                neg[j][t] = -alpha1 - alpha2 * inv / sum(1.0 / max(H[k][t], 1e-6) for k in act_m) * len(act_m)

    def standardise(vals):
        out = [[0.0] * WIDTH for _ in range(n_rows)]
        scopes = [range(n_rows)] if scope == "batch" else [range(g0, g0 + G) for g0 in range(0, n_rows, G)]
        for rows in scopes:
            xs = [vals[i][t] for i in rows for t in range(LENGTHS[i])]  # every token in scope, zeros included
            mean = sum(xs) / len(xs)
            std = math.sqrt(sum((v - mean) ** 2 for v in xs) / (len(xs) - 1))
            for i in rows:
                for t in range(LENGTHS[i]):
                    out[i][t] = (vals[i][t] - mean) / (std + 1e-4)
        return out

    a_pos, a_neg = standardise(pos), standardise(neg)
    adv = [[(a_pos if REWARDS[i] >= 1.0 else a_neg)[i][t] for t in range(WIDTH)] for i in range(n_rows)]
    return torch.tensor(pos), torch.tensor(neg), torch.tensor(adv, dtype=torch.float64)


@pytest.mark.parametrize("scope", ["batch", "group"])
def test_gtpo_advantages_and_loss(scope):
    batch = make_batch()
    batch.entropy[2, 1] = 1e-9  # a near-deterministic token of a failed completion: 1/H uses max(H, 1e-6)
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, ctx = run_algo("gtpo", batch, logp, scope=scope)
    assert algo.needs_entropy and not algo.needs_reference
    pos, neg, expected_adv = gtpo_reference(batch, scope=scope)
    close(adv, expected_adv * batch.mask.double())
    assert (adv[batch.mask.bool()] > 0).any() and (adv[batch.mask.bool()] < 0).any()
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            rho = torch.exp(x[i, t] - float(batch.old_logp[i, t]))
            total = total + clip_min(rho, float(expected_adv[i, t]), 0.8, 1.28)
    expected = -total / sum(LENGTHS)  # token-mean
    assert_loss_and_grad(loss, grad, x, expected)
    assert ctx.metrics["gtpo/success_frac"] == pytest.approx(sum(r >= 1 for r in REWARDS) / len(REWARDS))
    assert_split_invariant(algo, batch, logp)


def test_gtpo_one_sided_groups_leave_the_other_side_empty():
    """All-success group: no negative shaped rewards; all-failure group: no positive ones."""
    rewards = [1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 1.0, 0.0]
    batch = make_batch(rewards=rewards)
    pos, neg = rl_math.entropy_shaped_rewards(batch.rewards, batch.entropy, batch.mask, batch.rewards >= 1, G, 1.0, 0.1)
    assert (neg[:4] == 0).all() and (pos[4:8] == 0).all()
    # at t = 0 all four successes are active: their entropy shares sum to d_0 = 4
    assert float((pos[:4, 0] - 1.0).sum()) == pytest.approx(0.1 * 4)


# --------------------------------------------------------------------------- grpo-s


def test_grpo_s_advantages_and_loss():
    batch = make_batch()
    # sequence log-ratios around +-0.3: rows 0 (A > 0) and 1 (A < 0) leave [0.8, 1.28]
    logp = policy_logp(batch, scale=0.05, offsets=[0.3, -0.3, 0.0, 0.05, 0.1, -0.25, 0.0, 0.3, -0.4, 0.3, 0.0, 0.1])
    adv, loss, grad, algo, batch, out, _ = run_algo("grpo-s", batch, logp)
    assert algo.needs_entropy
    Hm = [sum(float(batch.entropy[i, t]) for t in range(L)) / L for i, L in enumerate(LENGTHS)]
    shaped = []
    for g0 in range(0, len(LENGTHS), G):
        rows = list(range(g0, g0 + G))
        plus = [i for i in rows if REWARDS[i] >= 1.0]
        minus = [i for i in rows if REWARDS[i] < 1.0]
        for i in rows:
            if i in plus:
                shaped.append(1.0 * REWARDS[i] + 0.1 * Hm[i] / sum(Hm[k] for k in plus) * len(plus))
            else:
                shaped.append(-1.0 - 0.1 * (1 / Hm[i]) / sum(1 / Hm[k] for k in minus) * len(minus))
    expected_adv = ref_group_adv(shaped)
    assert expected_adv[4:8].abs().sum() > 0  # the all-success group differs by entropy
    close(adv, expected_adv)
    x = lp64(logp)
    total = 0.0
    for i, L in enumerate(LENGTHS):
        s = torch.exp(sum(x[i, t] - float(batch.old_logp[i, t]) for t in range(L)) / L)
        total = total + clip_min(s, float(expected_adv[i]), 0.8, 1.28)
    expected = -total / len(LENGTHS)
    assert_loss_and_grad(loss, grad, x, expected)
    assert float(out.stats["clip_frac_low"][0]) + float(out.stats["clip_frac_high"][0]) > 0
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- grpo-lead


def test_grpo_lead_advantages():
    # lengths per group: [3,5,2,4] [4,4,1,5] [2,3,5,3]; correct = reward 1
    batch = make_batch()
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, ctx = run_algo("grpo-lead", batch, logp)
    R = []
    for g0 in range(0, len(LENGTHS), G):
        rows = range(g0, g0 + G)
        correct = [i for i in rows if REWARDS[i] >= 1.0]
        lens = [LENGTHS[i] for i in correct]
        mu = sum(lens) / len(lens) if lens else 0.0
        sigma = math.sqrt(sum((x - mu) ** 2 for x in lens) / (len(lens) - 1)) if len(lens) >= 2 else 1.0
        for i in rows:
            R.append(math.exp(-0.05 * (LENGTHS[i] - mu) / (sigma + 1e-6)) if i in correct else -1.0)
    base = ref_group_adv(R, eps=1e-6)

    def w(x):
        return 0.4 + (1.5 - 0.4) / (1 + math.exp(10 * (x - 0.75)))

    expected = []
    for i in range(len(LENGTHS)):
        g0 = (i // G) * G
        rho = sum(REWARDS[j] >= 1.0 for j in range(g0, g0 + G)) / G
        expected.append(base[i] * (w(rho) if base[i] > 0 else w(1 - rho)))
    expected = torch.tensor(expected, dtype=torch.float64)
    assert expected[4:8].abs().sum() > 0  # all correct, different lengths: shorter ones preferred
    assert float(expected[6]) > 0 and float(expected[7]) < 0  # length 1 beats length 5
    close(adv, expected)
    assert_split_invariant(algo, batch, logp)


# --------------------------------------------------------------------------- diver


def test_bleu_against_hand_computed_values():
    from rewards.diversity import bleu

    ref, hyp = "a b c d e g".split(), "a b c d e f".split()
    w = (0.02, 0.1, 0.15, 0.25, 0.38)
    p = [5 / 6, 4 / 5, 3 / 4, 2 / 3, 1 / 2]  # n-gram precisions, brevity penalty 1 (equal lengths)
    assert bleu(ref, hyp, w) == pytest.approx(math.exp(sum(wi * math.log(pi) for wi, pi in zip(w, p))), rel=1e-12)
    short = "a b c d e".split()  # hypothesis shorter than the reference: penalty exp(1 - 6/5)
    p = [1.0, 1.0, 1.0, 1.0, 1.0]
    assert bleu(ref, short, w) == pytest.approx(math.exp(1 - 6 / 5), rel=1e-12)
    assert bleu(ref, "a b c".split(), w) == 0.0  # no 4- or 5-gram at all
    assert bleu(ref, [], w) == 0.0


def test_diver_advantages_mix():
    texts = [
        "so $x+1$ and \\(y\\) give a b c d e f",  # formulas {x+1, y}
        "so $x+1$ and \\(y\\) give a b c d e f",  # identical to row 0
        "then \\[z=2\\] so", "nothing here",
        "p q r s t u", "p q r s t u", "v w", "\\(k\\)",
        "$a$", "$a$ $b$", "x", "y",
    ]
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    batch = make_batch(rewards=rewards, texts=texts)
    logp = policy_logp(batch)
    adv, loss, grad, algo, batch, out, ctx = run_algo("diver", batch, logp, diversity="mix")
    # TD by hand: identical 11-token texts have BLEU 1; every other pair here shares no 5-gram -> BLEU 0
    td = [2 / 3, 2 / 3, 1, 1, 2 / 3, 2 / 3, 1, 1, 1, 1, 1, 1]
    # ED by hand: rows 0/1 share both formulas; row 2 has {z=2}; row 8 {a} shared with row 9 {a, b}
    ed = [0, 0, 1, 0, 0, 0, 0, 1, 0, 0.5, 0, 0]
    shaped = [r + (0.1 * (min(t, 0.91) + min(e, 0.42)) if r >= 1 else 0.0) for r, t, e in zip(rewards, td, ed)]
    close(adv, ref_group_adv(shaped))
    assert ctx.metrics["diver/bonus"] > 0
    assert_split_invariant(algo, batch, logp)


def test_diver_bonus_stops_after_decay_steps():
    batch = make_batch(texts=[f"t{i} u v w" for i in range(12)])
    logp = policy_logp(batch)
    adv_late, *_ = run_algo("diver", batch, logp, step=5, decay_steps=5)
    close(adv_late, ref_group_adv(REWARDS))
    adv_early, *_ = run_algo("diver", make_batch(texts=[f"t{i} u v w" for i in range(12)]), logp, step=4, decay_steps=5)
    assert not torch.allclose(adv_early, adv_late)


# --------------------------------------------------------------------------- grpo-ps


def test_digits_step_match_by_hand():
    from rewards.digits import digits_match, digits_step_match

    ex = {"answer": "4712"}
    assert digits_step_match("p", ["47", "12"], ex) == [1.0, 1.0]
    assert digits_step_match("p", ["47", "1"], ex) == [1.0, 0.5]  # last step pays for the missing "2"
    assert digits_step_match("p", ["4", "9", "12"], ex) == [1.0, 0.0, 1.0]
    assert digits_step_match("p", ["47", "", "12"], ex) == [1.0, 0.0, 1.0]
    assert digits_step_match("p", ["4713"], ex) == pytest.approx(digits_match(["p"], ["4713"], ["4712"]))


def ps_batch():
    from grpo.foundation.modeling import load_tokenizer

    tok = load_tokenizer("builtin:tiny-char")
    texts = ["47\n\n12", "47", "4\n\n7\n\n", "9\n\n12",  # group 0: 2, 1, 2, 2 steps
             "4712", "4712", "4712", "4712",  # group 1: all equal
             "12\n\n47", "47\n\n1", "x", "47\n\n\n\n12"]  # group 2
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(len(x) for x in ids)
    batch = make_batch(lengths=[len(x) for x in ids], ids=ids, texts=texts, width=width)
    for it in batch.items:
        it["answer"] = "4712"
    return batch, texts, width


def test_grpo_ps_step_segmentation_rewards_and_advantages():
    batch, texts, width = ps_batch()
    logp = policy_logp(batch)
    cfg = load_config(None, "grpo-ps", [f"rollout.max_completion_length={width}"])
    algo = ALGORITHMS.get("grpo-ps")(cfg)
    ctx = StepContext(cfg, 0)
    batch = algo.process_batch(batch, ctx)
    adv = algo.advantages(batch, ctx).double()
    # steps, the token that ends each (the last one: EOS), and digits_step_match by hand
    steps = {
        0: ([3, 6], [1.0, 1.0]), 1: ([2], [0.5]), 2: ([2, 6], [1.0, 1 / 3]), 3: ([2, 5], [0.0, 0.0]),
        4: ([4], [1.0]), 5: ([4], [1.0]), 6: ([4], [1.0]), 7: ([4], [1.0]),
        8: ([3, 6], [0.0, 0.0]), 9: ([3, 5], [1.0, 0.5]), 10: ([1], [0.0]), 11: ([3, 5, 8], [1.0, 0.0, 1.0]),
    }
    for i, (ends, rewards) in steps.items():
        assert batch.extra["step_end"][i].nonzero().flatten().tolist() == ends, texts[i]
        assert [float(batch.extra["step_reward"][i, e]) for e in ends] == pytest.approx(rewards), texts[i]
    expected = torch.zeros(len(texts), width, dtype=torch.float64)
    for g0 in range(0, len(texts), G):
        R = [r for i in range(g0, g0 + G) for r in steps[i][1]]
        mean = sum(R) / len(R)
        std = math.sqrt(sum((r - mean) ** 2 for r in R) / (len(R) - 1))
        for i in range(g0, g0 + G):
            ends, rewards = steps[i]
            for t in range(len(batch.completion_ids[i])):
                expected[i, t] = sum((r - mean) / (std + 1e-4) for e, r in zip(ends, rewards) if e >= t)
    close(adv, expected)
    assert (adv[4:8] == 0).all() and (adv > 0).any() and (adv < 0).any()
    batch.advantages = adv.float()
    x = lp64(logp)
    lengths = [len(c) for c in batch.completion_ids]
    total = 0.0
    for i, L in enumerate(lengths):
        s = 0.0
        for t in range(L):
            rho = torch.exp(x[i, t] - float(batch.old_logp[i, t]))
            d = float(batch.ref_logp[i, t]) - x[i, t]
            s = s + clip_min(rho, float(expected[i, t]), 0.8, 1.2) - 0.04 * (torch.exp(d) - d - 1)
        total = total + s / L
    ref_loss = -total / len(lengths)
    ref_loss.backward()
    norms = rl_math.StepNorms(float(len(lengths)), float(sum(lengths)), width)
    lp = logp.clone().requires_grad_(True)
    out = algo.loss(lp, batch, norms)
    out.loss.backward()
    close(out.loss.detach(), ref_loss.detach())
    close(lp.grad, x.grad)
    assert ctx.metrics["grpo_ps/steps_per_completion"] == pytest.approx(sum(len(s[0]) for s in steps.values()) / 12)


def test_grpo_ps_step_reward_by_import_path_and_errors():
    cfg = load_config(None, "grpo-ps", ["algo.step_reward_fn=rewards.digits:digits_step_match"])
    from rewards.digits import digits_step_match

    assert ALGORITHMS.get("grpo-ps")(cfg).step_reward is digits_step_match
    with pytest.raises(ConfigError, match=r"algo\.step_reward_fn='nowhere\.mod:fn' cannot be imported"):
        load_config(None, "grpo-ps", ["algo.step_reward_fn=nowhere.mod:fn"])
    with pytest.raises(ConfigError, match=r"algo\.step_reward_fn='nope' is unknown"):
        load_config(None, "grpo-ps", ["algo.step_reward_fn=nope"])
    with pytest.raises(ConfigError, match=r"algo\.separator"):
        load_config(None, "grpo-ps", ["algo.separator="])


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["drgrpo", "gtpo", "grpo-s", "gspo", "gspo-token", "tic-grpo", "pspo",
                                  "lambda-grpo", "grpo-lambda", "grpo-lead", "diver", "grpo-ps"])
def test_preset_loads_and_names_its_algorithm(name):
    cfg = load_config(f"configs/{name}.yaml")
    assert cfg.algo.name == name
    assert cfg.model.name_or_path == "builtin:tiny-char" and cfg.data.source == "builtin"
