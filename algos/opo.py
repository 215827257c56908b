"""OPO: On-Policy RL with Optimal reward baseline (Hao et al., 2025, arXiv 2505.23585).

    b_g = sum_{j in g} |o_j| s_j / sum_{j in g} |o_j|      the length-weighted mean score of the group
    A_i = s_i - b_g                                        no std
    loss: GRPO's clipped surrogate, token-mean; beta = 0 (on-policy: mu = 1, the clip never binds)
Equal to verl's ``adv_estimator=opo``. s_i is the outcome score (minus the KL with algo.kl_in_reward).

Formulas, defaults and decisions: docs/algorithms.md, section opo.
"""

from __future__ import annotations

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math


class OPO(GRPO):
    name = "opo"
    paper = "OPO, optimal reward baseline (arXiv 2505.23585)"
    tag = "peer"
    summary = "baseline = length-weighted mean reward of the group, A = r - b; token-mean, no KL"
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("kl_in_reward",)

    def advantages(self, batch, ctx) -> torch.Tensor:
        G = batch.group_size
        s = rl_math.group_view(self.scores(batch, ctx).double(), G)
        n = rl_math.group_view(batch.mask.sum(-1).double(), G)
        baseline = (n * s).sum(1, keepdim=True) / n.sum(1, keepdim=True).clamp(min=1)
        return (s - baseline).reshape(-1).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
