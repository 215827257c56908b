"""DPPO-Binary-TV: divergence-based trust region (arXiv 2602.04879); verl ``policy_loss.loss_mode=dppo_tv``.

PPO's ratio clip barely constrains a token whose probability is high (0.99 -> 0.8 is a ratio of
0.81); DPPO masks a token out when the probability itself moved too far in the advantage's direction:
    valid_t = pi_t - pi_old,t <= delta_high   if A > 0        (delta = 0.15: total variation of the
              pi_t - pi_old,t >= -delta_low  if A <= 0         binary distribution {token, rest})
    L_t     = -A_t sg[min(rho_t, C)] log pi_t * valid_t       C = algo.ratio_cap = 20 (truncated IS)
    loss    = token-mean of L;  beta = 0
algo.clip_eps_low / clip_eps_high are the divergence thresholds here, not ratio bounds.

Formulas, defaults and decisions: docs/algorithms.md, section dppo-tv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation.config import ranged


@dataclass
class DPPOOptions:
    ratio_cap: float = ranged(20.0, "> 1", "default 20; verl's clip_ratio_c defaults to 3")  # C: the detached IS weight min(rho, C) (verl: clip_ratio_c, default 3 there)


class DPPOTV(Algorithm):
    name = "dppo-tv"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "DPPO, divergence proximal policy optimisation (arXiv 2602.04879)"
    tag = "peer"
    summary = "REINFORCE x truncated IS weight; tokens whose probability moved > 0.15 (TV) are masked"
    Options = DPPOOptions
    defaults = {"beta": 0.0, "clip_eps_low": 0.15, "clip_eps_high": 0.15, "aggregation": "token-mean",
                "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("clip_eps_low", "clip_eps_high", "ratio_cap", "num_iterations")

    def valid(self, logp: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept where A > 0, kept where A <= 0), detached."""
        diff = torch.exp(logp.detach()) - torch.exp(old)
        return diff <= self.a.clip_eps_high, diff >= -self.a.clip_eps_low

    def loss(self, logp, mb, norms) -> LossOutput:
        old = self.old_logp(logp, mb)
        ratio = torch.exp((logp - old).detach().clamp(-20.0, 20.0))
        adv = self.token_advantages(mb)
        pos, neg = self.valid(logp, old)
        valid = torch.where(adv > 0, pos, neg).to(logp.dtype)
        weight = ratio.clamp(max=self.opt.ratio_cap)
        dropped = 1.0 - valid
        stats = {"clip_frac_low": masked_stat(dropped * (adv <= 0), mb.mask),
                 "clip_frac_high": masked_stat(dropped * (adv > 0), mb.mask),
                 "ratio_mean": masked_stat(ratio, mb.mask),
                 "dppo/capped_frac": masked_stat((ratio > self.opt.ratio_cap).float() * valid, mb.mask)}
        return self.token_pg_loss(-adv * weight * logp * valid, logp, mb, norms, stats)
