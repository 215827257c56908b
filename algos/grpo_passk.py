"""GRPO for pass@k: only each group's best completion learns (verl ``adv_estimator=grpo_passk``, citing
Chen et al., 2025, arXiv 2503.19595).

    A_i = (s_max - s_second) / (std_g s + eps)     for i = the group's best completion (one of them)
    A_j = 0                                        for every other completion
std unbiased (algo.adv_std=none: no division), eps = 1e-6 (verl). Ties at the top give A = 0 whichever
is picked. Loss: GRPO's clipped surrogate, token-mean; beta = 0.

Formulas, defaults and decisions: docs/algorithms.md, section grpo-passk.
"""

from __future__ import annotations

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math


class GRPOPassK(GRPO):
    name = "grpo-passk"
    paper = "pass@k GRPO, verl grpo_passk (arXiv 2503.19595)"
    tag = "peer"
    summary = "only the best completion of a group gets A = (r_max - r_second) / std; token-mean, no KL"
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean", "adv_eps": 1e-6}
    knobs = ("adv_std", "adv_eps", "kl_in_reward")

    def advantages(self, batch, ctx) -> torch.Tensor:
        s = rl_math.group_view(self.scores(batch, ctx).double(), batch.group_size)
        top = s.topk(2, dim=1)
        gap = top.values[:, 0] - top.values[:, 1]
        if self.a.adv_std != "none":
            gap = gap / (s.std(dim=1, unbiased=self.a.adv_std == "unbiased") + self.a.adv_eps)
        adv = torch.zeros_like(s)
        adv[torch.arange(s.shape[0]), top.indices[:, 0]] = gap
        return adv.reshape(-1).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
