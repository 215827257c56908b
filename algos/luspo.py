"""LUSPO: Length-Unbiased Sequence Policy Optimization (arXiv 2602.05261): GSPO with each sequence's
loss scaled by its length.

    s_i = exp(1/|o_i| sum_t (l - l_old))                           GSPO's sequence ratio
    J   = 1/G sum_i |o_i| min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
GSPO's 1/G sum_i weighs every sequence alike, so a long completion's tokens each count less than a
short one's; the factor |o_i| gives every token the same weight. Equal to TRL's
``loss_type="luspo"`` with ``importance_sampling_level="sequence"``.

Formulas, defaults and decisions: docs/algorithms.md, section luspo.
"""

from __future__ import annotations

from algos.base import LossOutput
from algos.gspo import GSPO
from grpo.foundation import rl_math


class LUSPO(GSPO):
    name = "luspo"
    paper = "LUSPO (arXiv 2602.05261)"
    tag = "peer"
    summary = "GSPO with each sequence's clipped term times its length |o_i|"

    def loss(self, logp, mb, norms) -> LossOutput:
        ratio = rl_math.sequence_ratio(logp, self.old_logp(logp, mb), mb.mask)
        return self.sequence_ppo_loss(ratio, logp, mb, norms, scale=mb.mask.sum(-1))
