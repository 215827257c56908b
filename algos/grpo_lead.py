"""GRPO-LEAD: length-dependent rewards, explicit penalties, difficulty-aware advantage
reweighting (Zhang & Zuo, arXiv 2504.09696), as in the authors' code.

Per group, with "correct" = r >= correct_threshold:
    R_i = exp(-alpha z_i), z_i = (|o_i| - mu_L) / (sigma_L + 1e-6)     correct (mu_L, sigma_L unbiased over
                                                                      the group's correct ones; sigma_L = 1 if < 2)
    R_i = -1                                                          incorrect
    A~ = group advantage of R (eps 1e-6);  rho_q = #correct / G
    w(x) = A + (B - A) / (1 + exp(k (x - rho0)))                     A=0.4, B=1.5, k=10, rho0=0.75
    A = A~ w(rho_q) if A~ > 0, else A~ w(1 - rho_q)
The rest as GRPO. ``reward/*`` metrics keep the task reward; R is logged as ``grpo_lead/shaped_reward``.

Formulas, defaults and decisions: docs/algorithms.md, section grpo-lead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import log_mean
from algos.grpo import GRPO
from grpo.foundation import rl_math


@dataclass
class GRPOLeadOptions:
    alpha: float = 0.05  # length penalty strength
    correct_threshold: float = 1.0  # r >= this is correct
    weight_a: float = 0.4  # A: w's lower asymptote
    weight_b: float = 1.5  # B: w's upper asymptote
    weight_k: float = 10.0  # k: steepness
    weight_rho0: float = 0.75  # rho0: midpoint


class GRPOLead(GRPO):
    name = "grpo-lead"
    paper = "GRPO-LEAD (arXiv 2504.09696)"
    tag = "code"
    summary = "length-penalised correct rewards, -1 for wrong, advantages reweighted by difficulty"
    Options = GRPOLeadOptions
    defaults = {**GRPO.defaults, "adv_eps": 1e-6}
    knobs = ("alpha", "correct_threshold", "weight_a", "weight_b", "weight_k", "weight_rho0")

    def weight(self, x: torch.Tensor) -> torch.Tensor:
        o = self.opt
        return o.weight_a + (o.weight_b - o.weight_a) / (1.0 + torch.exp(o.weight_k * (x - o.weight_rho0)))

    def shaped_rewards(self, rewards: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
        correct = rl_math.group_view(rewards >= self.opt.correct_threshold, group_size)
        length = rl_math.group_view(lengths.double(), group_size)
        out = torch.full_like(length, -1.0)
        for g in range(length.shape[0]):
            lc = length[g][correct[g]]
            if lc.numel() == 0:
                continue
            mu = lc.mean()
            sigma = lc.std(unbiased=True) if lc.numel() >= 2 else torch.tensor(1.0, dtype=lc.dtype)
            out[g][correct[g]] = torch.exp(-self.opt.alpha * (lc - mu) / (sigma + 1e-6))
        return out.reshape(-1)

    def advantages(self, batch, ctx) -> torch.Tensor:
        G = batch.group_size
        shaped = self.shaped_rewards(batch.rewards, batch.lengths, G)
        adv = rl_math.group_advantages(shaped, G, self.a.adv_std, self.a.adv_eps, self.a.adv_scope)
        rho = rl_math.group_view((batch.rewards >= self.opt.correct_threshold).double(), G).mean(1)
        rho = rho.repeat_interleave(G)
        adv = torch.where(adv > 0, adv * self.weight(rho), adv * self.weight(1.0 - rho))
        log_mean(ctx, "grpo_lead/shaped_reward", shaped)
        log_mean(ctx, "grpo_lead/correct_frac", rho)
        return adv.to(batch.rewards.dtype)
