"""REINFORCE++-baseline (Hu et al., 2025, arXiv 2501.03262, the group-baseline variant).

    A_i  = s_i - mean_g s                 s_i = r_i - kl_in_reward * sum_t k1_i,t (the outcome score)
    A~   = (A - mean) / sqrt(var + 1e-8)  mean / unbiased var over every token of the step (A_i on each
                                          of row i's tokens, all ranks): verl's masked_whiten
    loss: GRPO's clipped surrogate, token-mean; beta = 0
Equal to verl's ``adv_estimator=reinforce_plus_plus_baseline``.

Formulas, defaults and decisions: docs/algorithms.md, section reinforce-pp-baseline.
"""

from __future__ import annotations

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math


class ReinforcePPBaseline(GRPO):
    name = "reinforce-pp-baseline"
    paper = "REINFORCE++-baseline (arXiv 2501.03262)"
    tag = "peer"
    summary = "group-mean baseline, then whitened over every token of the batch (not per group)"
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("kl_in_reward", "clip_eps_low", "clip_eps_high")

    def advantages(self, batch, ctx) -> torch.Tensor:
        centred = rl_math.group_advantages(self.scores(batch, ctx).double(), batch.group_size, "none")
        per_token = centred.unsqueeze(-1) * batch.mask.double()
        return rl_math.whiten(per_token, batch.mask).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
