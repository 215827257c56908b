"""REINFORCE++ (Hu et al., 2025, arXiv 2501.03262): no baseline per prompt, returns whitened over the batch.

    r_i,t = [t = |o_i|] r_i - kl_in_reward * k1_i,t          token rewards (k1 = l_old - l_ref)
    G_i,t = sum_{k >= t} gamma^(k-t) r_i,k                   discounted return (gamma = 1)
    A_i,t = (G_i,t - mean) / sqrt(var + 1e-8)                mean / unbiased var over every token of the
                                                             step (all ranks): verl's masked_whiten
    loss: GRPO's clipped surrogate with token advantages, token-mean; beta = 0
Equal to verl's ``adv_estimator=reinforce_plus_plus``. The paper puts the KL in the reward
(``algo.kl_in_reward``); verl's default leaves it out (0), and so do we.

Formulas, defaults and decisions: docs/algorithms.md, section reinforce-pp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import ranged


@dataclass
class ReinforcePPOptions:
    gamma: float = ranged(1.0, "in (0, 1]", "verl's default: 1.0")  # discount of the token returns


class ReinforcePP(GRPO):
    name = "reinforce-pp"
    paper = "REINFORCE++ (arXiv 2501.03262)"
    tag = "peer"
    summary = "token returns (outcome - KL-in-reward) whitened over the whole batch; no group baseline"
    Options = ReinforcePPOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("gamma", "kl_in_reward", "clip_eps_low", "clip_eps_high")
    group_relative = False  # no per-prompt baseline: one completion per prompt learns too

    def advantages(self, batch, ctx) -> torch.Tensor:
        returns = rl_math.discounted_returns(self.token_rewards(batch, ctx), batch.mask, self.opt.gamma)
        return rl_math.whiten(returns, batch.mask).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
