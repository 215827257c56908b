"""GRPO: DeepSeekMath (Shao et al., 2024, arXiv 2402.03300), eq. (3) with outcome supervision.

    A_i   = (r_i - mean(r)) / (std(r) + eps)                      group advantage
    l_i,t = min(rho A, clip(rho, 1 - eps, 1 + eps) A)             rho = pi / pi_old
    J     = 1/G sum_i 1/|o_i| sum_t [l_i,t - beta KL_k3]          seq-mean-token-mean

Formulas, defaults and decisions: docs/algorithms.md, section grpo.
"""

from __future__ import annotations

from algos.base import Algorithm, LossOutput
from grpo.foundation import rl_math


class GRPO(Algorithm):
    name = "grpo"
    paper = "DeepSeekMath (arXiv 2402.03300)"
    summary = "group-normalised advantage, token ratio, symmetric clip, k3 KL, seq-mean-token-mean"
    defaults = {"beta": 0.04, "clip_eps_low": 0.2, "clip_eps_high": 0.2, "aggregation": "seq-mean-token-mean",
                "adv_std": "unbiased", "adv_eps": 1e-4, "kl_estimator": "k3"}
    knobs = ("beta", "clip_eps_low", "clip_eps_high", "num_iterations")

    def loss(self, logp, mb, norms):
        per_token, stats = self.ppo_token_loss(logp, mb)
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)
