"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., 2024, arXiv 2402.14740, eq. (6); Kool et al., 2019).

    A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean_g r)        no division by a std
    loss: GRPO's clipped surrogate, token-mean over the step; beta = 0
Equal to verl's ``adv_estimator=rloo`` (and OpenRLHF's ``rloo``) with verl's default actor loss.
With ``algo.kl_in_reward`` > 0, r_i is the score r_i - coef sum_t k1 (verl's use_kl_in_reward).

Formulas, defaults and decisions: docs/algorithms.md, section rloo.
"""

from __future__ import annotations

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math


class RLOO(GRPO):
    name = "rloo"
    paper = "RLOO (arXiv 2402.14740)"
    tag = "peer"
    summary = "leave-one-out baseline A = r - mean of the other G-1 rewards; PPO clip, token-mean, no KL"
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("clip_eps_low", "clip_eps_high", "kl_in_reward")

    def advantages(self, batch, ctx) -> torch.Tensor:
        return rl_math.leave_one_out(self.scores(batch, ctx), batch.group_size).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
