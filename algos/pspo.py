"""PSPO: probability-smoothing policy optimisation (arXiv 2509.21282). [unverified]

Implemented as written in ALGORITHMS.md, not checked against the paper or code. The ratio is
smoothed toward the old policy instead of clipped:
    r~_{i,t} = (1 - alpha) rho_{i,t} + alpha
    J = 1/G sum_i 1/|o_i| sum_t r~_{i,t} A_i  (- beta KL)          no clipping
With alpha = 0 it is GRPO without clipping (a test shows it). No clipping happens, so no clip
fractions are logged; ``smoothed_ratio_mean`` is.
"""

from __future__ import annotations

from dataclasses import dataclass

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import core
from grpo.foundation.config import ConfigError


@dataclass
class PSPOOptions:
    alpha: float = 0.1  # smoothing weight toward the old policy, in [0, 1]


class PSPO(Algorithm):
    name = "pspo"
    paper = "PSPO, probability smoothing (arXiv 2509.21282)"
    tag = "unverified"
    summary = "ratio smoothed toward 1: (1 - alpha) rho + alpha, no clipping"
    Options = PSPOOptions
    defaults = {"beta": 0.04, "aggregation": "seq-mean-token-mean", "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("alpha", "beta", "num_iterations")

    @classmethod
    def validate(cls, cfg) -> None:
        alpha = cfg.algo.options.alpha
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"algo.alpha={alpha!r} is invalid: it must be in [0, 1]")

    def loss(self, logp, mb, norms) -> LossOutput:
        rho = core.token_ratio(logp, self.old_logp(logp, mb))
        smoothed = (1.0 - self.opt.alpha) * rho + self.opt.alpha
        per_token, stats = self.add_kl(-smoothed * self.token_advantages(mb), logp, mb)
        stats.update(ratio_mean=masked_stat(rho, mb.mask), smoothed_ratio_mean=masked_stat(smoothed, mb.mask))
        return LossOutput(core.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)
