"""Shared building blocks of the GRPO family (docs/algorithms.md, "Shared building blocks").

Every algorithm in ``algos/`` composes these; each exists exactly once. Tensors are
[rows, T] for per-token quantities and [rows] for per-sequence ones; ``mask`` is 1 on
completion tokens (up to and including EOS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from grpo.foundation import dist

StdKind = Literal["unbiased", "population", "none"]


# --------------------------------------------------------------------------- group statistics


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] -> [N / G, G] (rows are ordered group-major)."""
    if x.numel() % group_size:
        raise ValueError(f"{x.numel()} rows is not a multiple of the group size {group_size}")
    return x.view(-1, group_size)


def _std(x: torch.Tensor, kind: StdKind, dim: int = -1) -> torch.Tensor:
    if kind == "none":
        return torch.ones_like(x.mean(dim=dim))
    n = x.shape[dim]
    if kind == "unbiased" and n < 2:
        return torch.zeros_like(x.mean(dim=dim))
    return x.std(dim=dim, unbiased=(kind == "unbiased"))


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    std: StdKind = "unbiased",
    eps: float = 1e-4,
    scope: Literal["group", "batch"] = "group",
) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std r + eps); groups with all-equal rewards get A = 0.

    ``scope="batch"`` keeps the per-group mean but takes the std over the whole batch
    (all ranks), as PPO-Lite.
    """
    r = group_view(rewards.double(), group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if std == "none":
        adv = centred
    elif scope == "group":
        adv = centred / (_std(r, std, dim=1).unsqueeze(1) + eps)
    else:
        adv = centred / (global_std(rewards.double(), std) + eps)
    uniform = (r.max(dim=1).values - r.min(dim=1).values) == 0
    adv = torch.where(uniform.unsqueeze(1), torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(rewards.dtype)


def global_std(x: torch.Tensor, kind: StdKind = "unbiased", mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Std of ``x`` (masked entries only) over all ranks."""
    return global_mean_std(x, kind, mask)[1]


def global_mean_std(
    x: torch.Tensor, kind: StdKind = "unbiased", mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of ``x`` over every rank's (masked) entries, in float64."""
    x = x.double()
    m = torch.ones_like(x) if mask is None else mask.double()
    s = dist.all_reduce_sum(torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]))
    return _mean_std_from_sums(s[0], s[1], s[2], kind)


def _mean_std_from_sums(
    total: torch.Tensor, total_sq: torch.Tensor, n: torch.Tensor, kind: StdKind
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std from sum x, sum x^2 and the count (std 0 for a single unbiased sample)."""
    mean = total / n.clamp(min=1)
    var = (total_sq - n * mean * mean).clamp(min=0)
    if kind == "none":
        return mean, torch.ones_like(mean)
    denom = n - 1 if kind == "unbiased" else n
    return mean, (var / denom.clamp(min=1)).sqrt()


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N/G] bool: True where every reward in the group is equal (no learning signal)."""
    r = group_view(rewards, group_size)
    return (r.max(dim=1).values - r.min(dim=1).values) == 0


def valid_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (DAPO's dynamic sampling, GPG's B - M)."""
    return (~uniform_groups(rewards, group_size)).nonzero(as_tuple=True)[0].tolist()


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_g r), in float64."""
    r = group_view(rewards.double(), group_size)
    G = r.shape[1]
    return ((r - r.mean(dim=1, keepdim=True)) * G / (G - 1)).reshape(-1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over every masked entry on all ranks (unbiased var), 0 off the mask.
    verl's ``masked_whiten`` (REINFORCE++ and its baseline variant)."""
    mean, std = global_mean_std(x, "unbiased", mask)
    return (x.double() - mean) / torch.sqrt(std * std + eps) * mask.double()


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) m_k r_k on the masked positions ([rows, T])."""
    r = (token_rewards * mask).double()
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * mask.double()


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows, T]: each row's outcome reward on its last completion token, 0 elsewhere."""
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros_like(mask, dtype=torch.float64)
    out[torch.arange(mask.shape[0]), last] = rewards.double()
    return out * mask.double()


def token_covariance(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Clip-Cov / KL-Cov (arXiv 2505.22617): cov_t = (A_t - mean A)(l_t - mean l), the means over every
    masked token of the step (all ranks); 0 off the mask. ``adv`` is [rows] or [rows, T]."""
    a = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).double().expand_as(mask)
    l = logp.detach().double()
    mean_a = global_mean_std(a, "none", mask)[0]
    mean_l = global_mean_std(l, "none", mask)[0]
    return (a - mean_a) * (l - mean_l) * mask.double()


def global_rank_positions(local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """For a flat bool tensor of this rank's candidates: each candidate's index among every rank's
    candidates (rank order), and the total count."""
    counts = dist.all_gather_object(int(local.sum()))
    offset = sum(counts[: dist.rank()])
    return offset + torch.arange(int(local.sum())), sum(counts)


def global_top_k_mask(values: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """True on the ``k`` largest ``values`` among the valid entries of every rank (ties at the k-th value
    all count)."""
    pool = torch.cat([torch.as_tensor(v) for v in dist.all_gather_object(values[valid.bool()].double().cpu())])
    if k <= 0 or pool.numel() == 0:
        return torch.zeros_like(valid, dtype=torch.bool)
    threshold = pool.topk(min(k, pool.numel())).values[-1]
    return (values.double() >= threshold) & valid.bool()


# --------------------------------------------------------------------------- ratios


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """rho_{i,t} = exp(l - l_old)."""
    return torch.exp(logp - old_logp)


def tis_weight(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: w_{i,t} = min(pi_old / pi_sampler, C) = min(exp(l_old - l_sampler), C),
    without gradient; 1 outside the mask (padding never overflows into a NaN)."""
    d = torch.where(mask.bool(), old_logp.detach() - sampler_logp, torch.zeros_like(sampler_logp))
    return torch.exp(d).clamp(max=cap)


def rollout_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """pi_old / pi_sampler [rows, T], d_t = l_old - l_sampler on completion tokens (0 elsewhere): token r_t = exp(d_t);
    sequence r = exp(sum_t d_t); geometric r = exp(sum_t d_t / |o|) (each row's r on all its tokens)."""
    d = torch.where(mask.bool(), old_logp.detach() - sampler_logp, torch.zeros_like(sampler_logp))
    if level == "token":
        return torch.exp(d)
    total = d.sum(-1, keepdim=True)
    return torch.exp(total if level == "sequence" else total / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(d)


def bound_ratio(r: torch.Tensor, mode: str, high: float, low: Optional[float] = None) -> torch.Tensor:
    """truncate: clamp(r, low, high); mask: r where low <= r <= high, else 0 (``low`` None: no lower bound).
    Rollout correction's weight [rows, T] is ``rollout_ratio`` bounded by it (TRL's vllm_importance_sampling_mode
    *_truncate / *_mask; IcePop = token mask with [1/beta, beta]); tis_weight is token truncate without ``low``."""
    if mode == "truncate":
        return r.clamp(min=low, max=high)
    keep = (r <= high) & (r >= (low if low is not None else -math.inf))
    return torch.where(keep, r, torch.zeros_like(r))


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: log s_i = (1/|o_i|) sum_t m (l - l_old) (the mean, not the sum)."""
    return ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: s_i = exp(mean_t Delta)."""
    return torch.exp(sequence_log_ratio(logp, old_logp, mask))


def sequence_token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token: log s_{i,t} = l_{i,t} - sg[l_{i,t}] + sg[log s_i]: the value of s_i on every token,
    the gradient of l_{i,t} (so token-level advantages can be used)."""
    log_s = sequence_log_ratio(logp, old_logp, mask).detach().unsqueeze(-1)
    return torch.exp(logp - logp.detach() + log_s)


def trajectory_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TIC-GRPO: w_i = exp(clamp(sum_t m Delta, -20, 20))."""
    return torch.exp(((logp - old_logp) * mask).sum(-1).clamp(-20.0, 20.0))


# --------------------------------------------------------------------------- clipping


@dataclass
class Surrogate:
    """The clipped surrogate l and where clipping was active (for the clip fractions)."""

    value: torch.Tensor
    clipped_low: torch.Tensor  # ratio < lower bound and A < 0 (the bound is active)
    clipped_high: torch.Tensor  # ratio > upper bound and A > 0


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float | torch.Tensor,
    eps_high: float | torch.Tensor,
    dual_clip: Optional[float] = None,
    delta: Optional[float] = None,
) -> Surrogate:
    """l = min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); with dual clip c, l = max(l, c A) for A < 0;
    with ``delta`` (two-sided clip, INTELLECT-2 / TRL) the unclipped branch uses min(rho, delta).

    ``eps_low``/``eps_high`` may be tensors (per-token bounds, e.g. DCPO).
    """
    low, high = 1.0 - eps_low, 1.0 + eps_high
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low, dtype=ratio.dtype)), torch.as_tensor(high, dtype=ratio.dtype))
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    value = torch.minimum(unclipped * adv, clipped * adv)
    if dual_clip is not None:
        value = torch.where(adv < 0, torch.maximum(value, dual_clip * adv), value)
    return Surrogate(
        value=value,
        clipped_low=((ratio < low) & (adv < 0)).detach(),
        clipped_high=((ratio > high) & (adv > 0)).detach(),
    )


def dynamic_clip_bounds(
    old_logp: torch.Tensor, eps_low: float, eps_high: float, max_ratio: float = 10.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's per-token ratio bounds from the old token probability q = exp(l_old) (detached):

    r_low = 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0)),  r_high = min(0.5 + 0.5 sqrt(1 + 4 eps_high / q), max_ratio).
    """
    q = torch.exp(old_logp.detach())
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * eps_low / q, min=0.0))
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / q), max=max_ratio)
    return low, high


# --------------------------------------------------------------------------- KL


def distilled_advantages(adv: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                          mask: torch.Tensor, coef: float) -> torch.Tensor:
    """On-policy distillation's dense term (slime's ``--use-opd``; Thinking Machines' per-token reverse KL reward):
    A_t - coef * (log pi_student(o_t) - log pi_teacher(o_t)) on every completion token, 0 elsewhere. ``adv``: [rows]
    (one per completion, broadcast over its tokens) or [rows, T]; the log-probs are of the sampled tokens (the
    student's detached: pi_old, the policy that sampled them)."""
    dtype = torch.promote_types(adv.dtype, teacher_logp.dtype)
    per_token = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).to(dtype)
    gap = (student_logp.detach() - teacher_logp).to(dtype)
    return (per_token - coef * gap) * mask.to(dtype)


def topk_divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, tail: bool = True) -> torch.Tensor:
    """GKD's generalized JSD (Agarwal et al. 2024, eq. 1) over the teacher's top-k next tokens at each position, as
    TRL's server distillation computes it (``_jsd_divergence`` after ``_add_tail_bucket``). ``student`` and
    ``teacher``: [..., k] log-probs of the same k tokens (the teacher's most likely); returns [...].

    The support: with ``tail`` the k tokens plus one bucket for the rest, log(1 - sum_i exp(lp_i)) (the sum kept
    below 1, log-sum <= -1e-7); without it both sides renormalised over the k tokens. Then with s, t the student's
    and the teacher's distributions on it: beta 0 gives KL(t || s) = sum_i t_i (log t_i - log s_i) (forward), beta 1
    gives KL(s || t) (reverse), and between beta KL(t || m) + (1 - beta) KL(s || m) with m = beta t + (1 - beta) s.
    """
    def on_support(lp: torch.Tensor) -> torch.Tensor:
        if tail:
            log_sum = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=-1e-7)
            return torch.cat([lp, torch.log(-torch.expm1(log_sum))], dim=-1)
        return lp - torch.logsumexp(lp, dim=-1, keepdim=True)

    s, t = on_support(student), on_support(teacher.to(student.dtype))
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


K3_LOG_RATIO_CLAMP = 20.0  # |d| before exp in k3 (verl's low_var_kl bound on d)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k2", "k3"] = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimators with d = l_ref - l: k1 = -d, k2 = d^2/2, k3 = e^d - d - 1.

    k3 clamps d to [-20, 20] before exp, as verl's ``low_var_kl`` does: unclamped, one token far
    from the reference overflows exp (float32 past d = 88) and the loss and every gradient become
    inf or nan. For |d| <= 20 value and gradient are exact (TRL's unclamped k3); beyond, a token adds
    at most e^20 - 21 (about 4.9e8, finite in float32) and no gradient. verl's second clamp, k3 to
    [-10, 10], is not applied: it already bites at d = 2.61 (the policy at 7% of the reference's
    probability, common in training) and would cut the KL gradient exactly where it pulls hardest.
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}: choose from ['k1', 'k2', 'k3']")


# --------------------------------------------------------------------------- aggregation


AGGREGATIONS = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum-norm",
    "seq-mean-token-sum",
    "seq-sum-token-mean",
)


@dataclass
class StepNorms:
    """Normalisers of one whole optimizer step (all micro-batches, all ranks)."""

    num_seqs: float  # N
    num_tokens: float  # sum_i |o_i|
    max_len: int  # L_max (max_completion_length)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, kind: str, norms: StepNorms) -> torch.Tensor:
    """Reduce per-token losses [rows, T] to this micro-batch's share of the step loss.

    Summing the result over every micro-batch and rank gives exactly the loss of the
    whole step, so the gradient does not depend on how the batch is split.
    """
    masked = loss * mask
    if kind == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norms.num_seqs
    if kind == "token-mean":
        return masked.sum() / max(norms.num_tokens, 1.0)
    if kind == "seq-mean-token-sum-norm":
        return masked.sum() / (norms.num_seqs * norms.max_len)
    if kind == "seq-mean-token-sum":
        return masked.sum() / norms.num_seqs
    if kind == "seq-sum-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    raise ValueError(f"unknown aggregation {kind!r}: choose from {list(AGGREGATIONS)}")


def sequence_mean(per_seq: torch.Tensor, norms: StepNorms) -> torch.Tensor:
    """(1/N) sum_i x_i for sequence-level losses (GSPO, TIC-GRPO, GRPO-S)."""
    return per_seq.sum() / norms.num_seqs


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# --------------------------------------------------------------------------- token-level statistics


def standardize(
    x: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    scope: Literal["group", "batch"] = "group",
    std: StdKind = "unbiased",
    eps: float = 1e-4,
) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of each group ([rows, T], rows group-major),
    or over every masked entry of the whole batch on all ranks (``scope="batch"``).

    Used for token-level rewards (GTPO) and step rewards (process supervision); the result is 0
    where the mask is 0.
    """
    xd, md = x.double(), mask.double()
    if scope == "batch":
        mean, sd = global_mean_std(xd, std, md)
    else:
        g, m = xd.reshape(-1, group_size * xd.shape[-1]), md.reshape(-1, group_size * xd.shape[-1])
        mean, sd = _mean_std_from_sums((g * m).sum(-1, keepdim=True), (g * g * m).sum(-1, keepdim=True),
                                       m.sum(-1, keepdim=True), std)
        mean, sd = mean.expand_as(g).reshape_as(xd), sd.expand_as(g).reshape_as(xd)
    return (((xd - mean) / (sd + eps)) * md).to(x.dtype)


def suffix_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """y_t = sum_{k >= t} x_k on the masked positions (process supervision: the return of a token
    is the sum of the rewards of every step that ends at or after it)."""
    return x.flip(-1).cumsum(-1).flip(-1) * mask


def entropy_shaped_rewards(
    rewards: torch.Tensor,
    entropy: torch.Tensor,
    active: torch.Tensor,
    success: torch.Tensor,
    group_size: int,
    w_outcome: float,
    w_entropy: float,
    min_entropy: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy-shaped rewards of GTPO / GRPO-S (arXiv 2508.04349), per group.

    ``entropy`` is [N] (GRPO-S: one value per completion) or [N, T] (GTPO: per token, with
    ``active`` the token mask). Among the active members of one group (and position):
      pos_i = w_outcome * r_i + w_entropy * H_i / sum_{k in O+} H_k * |O+|      (successful i)
      neg_j = -w_outcome - w_entropy * (1/H_j) / sum_{k in O-} (1/H_k) * |O-|   (failed j)
    with 1/H using max(H, min_entropy). Returns (pos, neg), each 0 where it does not apply.
    """
    shape = entropy.shape
    G = group_size
    trail = (1,) * (len(shape) - 1)
    h = entropy.double().reshape(-1, G, *shape[1:])
    act = active.bool().reshape(-1, G, *shape[1:])
    succ = success.bool().reshape(-1, G, *trail)
    r = rewards.double().reshape(-1, G, *trail)
    pos_members, neg_members = act & succ, act & ~succ

    def share(w: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        w = torch.where(members, w, torch.zeros_like(w))
        total = w.sum(1, keepdim=True)
        count = members.double().sum(1, keepdim=True)
        return torch.where(members, w / total.clamp(min=1e-30) * count, torch.zeros_like(w))

    zero = torch.zeros_like(h)
    pos = torch.where(pos_members, w_outcome * r + w_entropy * share(h, pos_members), zero)
    inv = 1.0 / h.clamp(min=min_entropy)
    neg = torch.where(neg_members, -w_outcome - w_entropy * share(inv, neg_members), zero)
    return pos.reshape(shape), neg.reshape(shape)


def prefix_counts(completion_ids: list[list[int]], group_size: int, width: int) -> torch.Tensor:
    """[rows, width]: |lambda(i, t)| = how many completions of i's group start with o_{i, <=t}
    (duplicates count, i itself included). lambda-GRPO's prefix tree (arXiv 2509.21154)."""
    out = torch.zeros(len(completion_ids), width)
    for g0 in range(0, len(completion_ids), group_size):
        rows = range(g0, g0 + group_size)
        root: dict = {}  # token -> [count, children]
        for i in rows:
            children = root
            for tok in completion_ids[i][:width]:
                node = children.setdefault(tok, [0, {}])
                node[0] += 1
                children = node[1]
        for i in rows:
            children = root
            for t, tok in enumerate(completion_ids[i][:width]):
                out[i, t] = children[tok][0]
                children = children[tok][1]
    return out


def eligibility_weights(length: int, decay: float, mode: Literal["recent", "both"] = "recent") -> torch.Tensor:
    """[T, T] lower-triangular w_{t,k} of GRPO-lambda (arXiv 2510.00194), 0-based t and k:
    "recent": decay^(t-k); "both": max(decay^(t-k), decay^k) (decay^(k-1) with 1-based k).

    Exact and simple at O(T^2) memory (64 MB in float32 for T = 4096)."""
    t = torch.arange(length, dtype=torch.float64)
    lag = t.unsqueeze(1) - t.unsqueeze(0)
    w = torch.pow(torch.tensor(decay, dtype=torch.float64), lag.clamp(min=0))
    if mode == "both":
        w = torch.maximum(w, torch.pow(torch.tensor(decay, dtype=torch.float64), t).unsqueeze(0))
    elif mode != "recent":
        raise ValueError(f"unknown eligibility trace mode {mode!r}: choose from ['recent', 'both']")
    return torch.where(lag >= 0, w, torch.zeros_like(w))


def trace_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, decay: float,
                    mode: Literal["recent", "both"] = "recent") -> torch.Tensor:
    """GRPO-lambda: log rho~_{i,t} = sum_{k <= t} w_{t,k} m_{i,k} (l_{i,k} - l^old_{i,k})."""
    w = eligibility_weights(logp.shape[-1], decay, mode).to(device=logp.device, dtype=logp.dtype)
    return ((logp - old_logp) * mask) @ w.T
