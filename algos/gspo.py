"""GSPO: Group Sequence Policy Optimization (Zheng et al., 2025, arXiv 2507.18071), eq. (5)-(7).

    s_i = (pi(o_i|q) / pi_old(o_i|q))^(1/|o_i|) = exp(1/|o_i| sum_t (l - l_old))   the mean, not the sum
    J   = 1/G sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)                 beta = 0
A_i is GRPO's group advantage. Equal to TRL's ``importance_sampling_level="sequence"`` with
``loss_type="grpo"``. With mu = 1 and on-policy data s_i = 1 and the clip never binds; it acts
when the batch is reused (``algo.num_iterations`` > 1).

Formulas, defaults and decisions: docs/algorithms.md, section gspo.
"""

from __future__ import annotations

from algos.base import Algorithm, LossOutput
from grpo.foundation import rl_math


class GSPO(Algorithm):
    name = "gspo"
    token_level_pg = False  # one ratio per sequence: algo.tis_cap does not apply
    paper = "GSPO (arXiv 2507.18071)"
    summary = "sequence ratio s_i (geometric mean), sequence-level clip 3e-4/4e-4, no KL"
    defaults = {"beta": 0.0, "clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "aggregation": "seq-mean-token-mean",
                "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("clip_eps_low", "clip_eps_high", "num_iterations")

    def loss(self, logp, mb, norms) -> LossOutput:
        ratio = rl_math.sequence_ratio(logp, self.old_logp(logp, mb), mb.mask)
        return self.sequence_ppo_loss(ratio, logp, mb, norms)
