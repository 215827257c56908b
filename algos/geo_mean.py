"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., 2025, arXiv 2507.20673, eq. (4)); verl
``policy_loss.loss_mode=geo_mean``.

The geometric mean of the token ratios instead of their arithmetic mean, each token's log-ratio
clipped in the direction of the advantage's sign first:
    d_t   = l_t - l_old,t
    d~_t  = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high))        (eps 0.4: ratio in e^(+-0.4))
    s_i   = exp( sum_t d~_t / |o_i| )
    loss  = -(1/N) sum_i A_i s_i                                               one term per sequence
A token far from pi_old moves the geometric mean less than the arithmetic one, so GMPO can use a wider
clip than GRPO.

Formulas, defaults and decisions: docs/algorithms.md, section geo-mean.
"""

from __future__ import annotations

import torch

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import rl_math


class GeoMean(Algorithm):
    name = "geo-mean"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    token_level_pg = False  # one ratio per sequence
    paper = "GMPO, Geometric-Mean Policy Optimization (arXiv 2507.20673)"
    tag = "peer"
    summary = "geometric mean of token ratios, each log-ratio clipped to +-0.4 by the sign of A; per sequence"
    defaults = {"beta": 0.0, "clip_eps_low": 0.4, "clip_eps_high": 0.4, "aggregation": "seq-mean-token-mean",
                "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("clip_eps_low", "clip_eps_high", "num_iterations")

    def loss(self, logp, mb, norms) -> LossOutput:
        adv = mb.advantages
        if adv.dim() != 1:
            raise ValueError(f"{self.name}: the geometric mean needs one advantage per completion")
        d = logp - self.old_logp(logp, mb)
        sgn = torch.sign(adv).unsqueeze(-1)
        d_clip = d.clamp(-self.a.clip_eps_low, self.a.clip_eps_high)
        d_min = sgn * torch.minimum(sgn * d, sgn * d_clip)
        ratio = torch.exp((d_min * mb.mask).sum(-1) / mb.mask.sum(-1).clamp(min=1))
        loss = -rl_math.sequence_mean(adv * ratio, norms)
        clipped = (d != d_clip).float()
        stats = {"clip_frac_low": masked_stat(clipped * (adv < 0).unsqueeze(-1), mb.mask),
                 "clip_frac_high": masked_stat(clipped * (adv > 0).unsqueeze(-1), mb.mask),
                 "ratio_mean": masked_stat(ratio, torch.ones_like(ratio))}
        if self.a.beta > 0:
            kl_tok, kl_stats = self.add_kl(torch.zeros_like(logp), logp, mb)
            loss = loss + rl_math.aggregate(kl_tok, mb.mask, self.a.aggregation, norms)
            stats.update(kl_stats)
        return LossOutput(loss, stats)
