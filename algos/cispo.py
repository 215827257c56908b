"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, eq. (4)-(5)).

    r_i,t = pi / pi_old                                     token ratio
    w_i,t = sg[clip(r_i,t, 1 - eps_low_IS, 1 + eps_high_IS)] the weight is clipped, never the gradient
    J     = sum_i sum_t w_i,t A_i log pi_i,t / sum_i |o_i|  token-mean over the whole step
Every token keeps its gradient A * grad log pi (PPO's clip drops the clipped tokens'); only the weight
is bounded. Default: the upper bound only, 1 + eps_high = 5 (ScaleRL's recommendation, the value TRL's
docs give for ``loss_type="cispo"``); ``algo.lower_clip=true`` adds verl's lower bound 1 - eps_low.

Formulas, defaults and decisions: docs/algorithms.md, section cispo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import rl_math


@dataclass
class CISPOOptions:
    lower_clip: bool = False  # also clip the weight below at 1 - clip_eps_low (verl's cispo); TRL: upper only


class CISPO(Algorithm):
    name = "cispo"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "CISPO, MiniMax-M1 (arXiv 2506.13585)"
    tag = "peer"
    summary = "REINFORCE on log pi weighted by the detached, clipped IS ratio; token-mean; no KL"
    Options = CISPOOptions
    defaults = {"beta": 0.0, "clip_eps_low": 0.2, "clip_eps_high": 4.0, "aggregation": "token-mean",
                "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("clip_eps_high", "lower_clip", "num_iterations")

    def loss(self, logp: torch.Tensor, mb, norms: rl_math.StepNorms) -> LossOutput:
        ratio = rl_math.token_ratio(logp, self.old_logp(logp, mb)).detach()
        low = 1.0 - self.a.clip_eps_low if self.opt.lower_clip else 0.0
        high = 1.0 + self.a.clip_eps_high
        weight = ratio.clamp(min=low, max=high)
        adv = self.token_advantages(mb)
        stats = {
            "clip_frac_low": masked_stat((ratio < low).float(), mb.mask),
            "clip_frac_high": masked_stat((ratio > high).float(), mb.mask),
            "ratio_mean": masked_stat(ratio, mb.mask),
        }
        return self.token_pg_loss(-weight * adv * logp, logp, mb, norms, stats)
