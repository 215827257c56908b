"""GSPO-token (Zheng et al., 2025, arXiv 2507.18071), eq. (13)-(14).

    log s_{i,t} = l_{i,t} - sg[l_{i,t}] + sg[1/|o_i| sum_t (l - l_old)]
    J = 1/G sum_i 1/|o_i| sum_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})     seq-mean-token-mean
s_{i,t} has the value of s_i and the gradient of a token; with A_{i,t} = A_i it equals GSPO in
value and gradient (tests/test_algos_losses.py shows it), and it accepts token-level advantages.

Formulas, defaults and decisions: docs/algorithms.md, section gspo-token.
"""

from __future__ import annotations

from algos.base import LossOutput
from algos.gspo import GSPO
from grpo.foundation import rl_math


class GSPOToken(GSPO):
    name = "gspo-token"
    token_level_pg = True  # per-token surrogate (ppo_token_loss)
    paper = "GSPO-token (arXiv 2507.18071)"
    summary = "GSPO's sequence ratio carried per token (token-level advantages possible)"

    def loss(self, logp, mb, norms) -> LossOutput:
        ratio = rl_math.sequence_token_ratio(logp, self.old_logp(logp, mb), mb.mask)
        per_token, stats = self.ppo_token_loss(logp, mb, ratio)
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)
