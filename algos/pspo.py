"""PSPO: probability-smoothing policy optimisation (arXiv 2509.21282). [code]

Checked against the authors' code (their TRL patch and training script); docs/algorithms.md, "pspo".
The token ratio is smoothed toward the old policy and used in place of rho, with no clipping
and no min:
    r~_{i,t} = (1 - alpha) rho_{i,t} + alpha
    L_{i,t}  = -r~_{i,t} A_i  (+ beta KL when beta > 0)       dL/dl_{i,t} = -(1 - alpha) rho_{i,t} A_i
Defaults as the authors' runs: alpha = 0.1, token-mean over the step's tokens (TRL's "dapo" loss
type), beta = 0, mu = num_iterations = 2 (with mu = 1 on-policy rho = 1 and the gradient is
GRPO's scaled by 1 - alpha), group-std advantages. With alpha = 0 it is GRPO without clipping
(a test shows it). No clipping happens, so no clip fractions are logged; ``smoothed_ratio_mean`` is.
"""

from __future__ import annotations

from dataclasses import dataclass

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import rl_math
from grpo.foundation.config import ranged


@dataclass
class PSPOOptions:
    alpha: float = ranged(0.1, "in [0, 1]")  # smoothing weight toward the old policy, in [0, 1]


class PSPO(Algorithm):
    name = "pspo"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "PSPO, probability smoothing (arXiv 2509.21282)"
    tag = "code"
    summary = "ratio smoothed toward 1: (1 - alpha) rho + alpha, no clipping"
    Options = PSPOOptions
    defaults = {"beta": 0.0, "aggregation": "token-mean", "adv_std": "unbiased", "adv_eps": 1e-4, "num_iterations": 2}
    knobs = ("alpha", "beta", "num_iterations")

    def loss(self, logp, mb, norms) -> LossOutput:
        rho = rl_math.token_ratio(logp, self.old_logp(logp, mb))
        smoothed = (1.0 - self.opt.alpha) * rho + self.opt.alpha
        per_token, stats = self.tis(-smoothed * self.token_advantages(mb), logp, mb)
        per_token, kl_stats = self.add_kl(per_token, logp, mb)
        stats.update(kl_stats)
        stats.update(ratio_mean=masked_stat(rho, mb.mask), smoothed_ratio_mean=masked_stat(smoothed, mb.mask))
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)
