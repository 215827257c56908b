"""DRO: REINFORCE with a quadratic log-ratio penalty (verl's ``policy_loss.loss_mode=dro``).

    L_i,t = -( A_i log pi_i,t - (beta_dro / 2) (log pi_i,t - log pi_old,i,t)^2 )
    loss  = token-mean of L over the whole step (algo.aggregation); beta (the KL to the reference) = 0
The square keeps each update near the policy that sampled the batch without a ratio clip: its gradient
beta_dro (l - l_old) is 0 on the first pass, so the penalty acts from the second pass on (μ > 1, the
preset's 2) and when the sampler is not the trainer. ``algo.dro_beta`` has no default (verl requires it too).

Formulas, defaults and decisions: docs/algorithms.md, section dro.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import rl_math
from grpo.foundation.config import Config, ConfigError


@dataclass
class DROOptions:
    dro_beta: Optional[float] = None  # the penalty's coefficient (> 0); required


class DRO(Algorithm):
    name = "dro"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "DRO, verl policy_loss dro (REINFORCE + quadratic log-ratio penalty)"
    tag = "peer"
    summary = "REINFORCE on log pi minus dro_beta/2 (log pi - log pi_old)^2, no clip; token-mean; no KL"
    Options = DROOptions
    defaults = {"beta": 0.0, "aggregation": "token-mean", "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("dro_beta", "num_iterations")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        b = cfg.algo.options.dro_beta
        if b is None or not b > 0:
            raise ConfigError(f"algo.dro_beta={b!r} is invalid: dro needs the penalty's coefficient, > 0 (no default, "
                              f"as verl's dro_beta; configs/dro.yaml uses 0.1)")

    def loss(self, logp: torch.Tensor, mb, norms: rl_math.StepNorms) -> LossOutput:
        log_ratio = logp - self.old_logp(logp, mb)
        pg = -(self.token_advantages(mb) * logp - 0.5 * self.opt.dro_beta * log_ratio.square())
        zero = torch.zeros_like(logp)
        stats = {"clip_frac_low": masked_stat(zero, mb.mask), "clip_frac_high": masked_stat(zero, mb.mask),
                 "ratio_mean": masked_stat(log_ratio.detach().exp(), mb.mask),
                 "dro/sq_log_ratio": masked_stat(log_ratio.detach().square(), mb.mask)}
        return self.token_pg_loss(pg, logp, mb, norms, stats)
