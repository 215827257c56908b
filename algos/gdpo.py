"""GDPO: Group reward-Decoupled normalization Policy Optimization (arXiv 2601.05242).

Each reward function k is normalised within the group on its own, before the weighted sum, so that
a function with a large spread does not drown the others:
    A_k,i = (r_k,i - mean_g r_k) / (std_g r_k + eps)      per function, per group (unbiased std)
    S_i   = sum_k w_k A_k,i                                w_k = rewards[k].weight
    A_i   = (S_i - mean S) / (std S + eps)                 over every completion of the step (all ranks)
    loss: GRPO's clipped surrogate, seq-mean-token-mean, beta = 0.04 (GRPO's)
eps = algo.adv_eps (1e-4, TRL). Equal to TRL's ``multi_objective_aggregation="normalize_then_sum"``;
verl's ``adv_estimator=gdpo`` whitens S over tokens instead (docs/algorithms.md). The per-function
rewards are ``batch.reward_terms`` (raw, before weighting), named as in the metrics. With one reward
function, A is GRPO's advantage renormalised over the batch.

A function that returned ``None`` for a row (nan in ``reward_terms``: it does not score that row) is left out
of its group's statistics for that function, and the row gets 0 from it, as TRL (``nanmean``/``nanstd`` over
the group, then ``nansum`` over functions); a group with fewer than two scored rows, or all of them equal,
contributes 0, as a group with equal rewards does in GRPO.

Formulas, defaults and decisions: docs/algorithms.md, section gdpo.
"""

from __future__ import annotations

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import Config, ConfigError
from grpo.scoring.combined import term_names


class GDPO(GRPO):
    name = "gdpo"
    paper = "GDPO (arXiv 2601.05242)"
    tag = "peer"
    summary = "each reward function group-normalised on its own, weighted sum, then normalised over the batch"
    knobs = ("adv_eps", "beta")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.env.name:
            raise ConfigError(f"gdpo normalises each reward function on its own, and env.name={cfg.env.name!r} "
                              f"scores trajectories with the environment's terms: unset env.name or choose grpo")

    def advantages(self, batch, ctx) -> torch.Tensor:
        specs = self.cfg.rewards
        names = term_names(specs)
        missing = [n for n in names if n not in batch.reward_terms]
        if missing:
            raise RuntimeError(f"gdpo: the batch has no per-function rewards for {missing} "
                               f"(it has {sorted(batch.reward_terms)})")
        total = torch.zeros(len(batch), dtype=torch.float64)
        for name, spec in zip(names, specs):
            r = batch.reward_terms[name].double()
            total = total + spec.weight * scored_group_advantages(r, batch.group_size, self.a.adv_std,
                                                                  self.a.adv_eps)
        mean, std = rl_math.global_mean_std(total, "unbiased")
        return ((total - mean) / (std + self.a.adv_eps)).to(batch.rewards.dtype)


def scored_group_advantages(r: torch.Tensor, group_size: int, std: rl_math.StdKind, eps: float) -> torch.Tensor:
    """rl_math.group_advantages over the rows a function scored (nan: skipped), float64; skipped rows get 0.

    Without nan it equals rl_math.group_advantages. Groups with fewer than 2 scored rows or all scored rows equal: 0.
    """
    g = rl_math.group_view(r.double(), group_size)
    scored = ~torch.isnan(g)
    n = scored.sum(dim=1, keepdim=True).double()
    zero = torch.zeros_like(g)
    mean = torch.where(scored, g, zero).sum(dim=1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(scored, g - mean, zero)
    if std == "none":
        adv = centred
    else:
        dof = (n - 1) if std == "unbiased" else n
        adv = centred / (torch.sqrt((centred ** 2).sum(dim=1, keepdim=True) / dof.clamp(min=1)) + eps)
    inf = torch.full_like(g, float("inf"))
    spread = torch.where(scored, g, -inf).max(dim=1).values - torch.where(scored, g, inf).min(dim=1).values
    flat = ((n.squeeze(1) < 2) | (spread == 0)).unsqueeze(1)
    return torch.where(flat | ~scored, zero, adv).reshape(-1)
