"""DPPO-Binary-KL (arXiv 2602.04879); verl ``policy_loss.loss_mode=dppo_kl``: dppo-tv with the KL of the
binary distributions {token, rest} as the divergence.

    D_t     = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))      q = pi_old,t, p = pi_t
    valid_t = D_t <= delta_high or p <= q   if A > 0;   D_t <= delta_low or p >= q   if A <= 0
    L_t     = -A_t sg[min(rho_t, 20)] log pi_t * valid_t;   token-mean        (delta = 0.05)

Formulas, defaults and decisions: docs/algorithms.md, section dppo-kl.
"""

from __future__ import annotations

import torch

from algos.dppo_tv import DPPOTV


class DPPOKL(DPPOTV):
    name = "dppo-kl"
    summary = "dppo-tv with the binary KL > 0.05 as the mask"
    defaults = {**DPPOTV.defaults, "clip_eps_low": 0.05, "clip_eps_high": 0.05}

    def valid(self, logp: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp = logp.detach()
        p, q = torch.exp(lp), torch.exp(old)
        kl = q * (old - lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        return (kl <= self.a.clip_eps_high) | (p <= q), (kl <= self.a.clip_eps_low) | (p >= q)
