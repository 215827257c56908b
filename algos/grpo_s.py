"""GRPO-S: sequence-level entropy-shaped rewards (Tan et al., "GTPO and GRPO-S", arXiv 2508.04349 v5).

H^_k = 1/|o_k| sum_t H_{k,t} (the old policy's mean token entropy). Per group, O+ = completions
with r >= success_threshold (n of them), O- the rest (m):
    r^+_i = beta1 r_i + beta2 H^_i / sum_{k in O+} H^_k * n                    i in O+
    r^-_j = -beta1 - beta2 (1/H^_j) / sum_{k in O-} (1/H^_k) * m               j in O-
A = GRPO's group advantage of r^; then gspo's loss: sequence ratio s_i (geometric mean, the paper's
Algorithm 1);
J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); beta = 0, eps 0.2 / 0.28.

Formulas, defaults and decisions: docs/algorithms.md, section grpo-s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import log_mean
from algos.gspo import GSPO
from grpo.foundation import rl_math


@dataclass
class GRPOSOptions:
    beta1: float = 1.0  # weight of the outcome reward
    beta2: float = 0.1  # weight of the entropy bonus
    success_threshold: float = 1.0  # r >= this is a success (the maximum of a 0/1 reward)


class GRPOS(GSPO):
    name = "grpo-s"
    paper = "GRPO-S, entropy-shaped sequence rewards (arXiv 2508.04349 v5)"
    summary = "sequence rewards shaped by mean entropy, group advantage, sequence ratio and clip"
    Options = GRPOSOptions
    defaults = {**GSPO.defaults, "clip_eps_low": 0.2, "clip_eps_high": 0.28}
    knobs = ("beta1", "beta2", "success_threshold")

    @property
    def needs_entropy(self) -> bool:
        return True

    def advantages(self, batch, ctx) -> torch.Tensor:
        G = batch.group_size
        mean_entropy = rl_math.masked_mean(batch.entropy, batch.mask, dim=-1)
        success = batch.rewards >= self.opt.success_threshold
        pos, neg = rl_math.entropy_shaped_rewards(batch.rewards, mean_entropy, torch.ones_like(success), success, G,
                                               self.opt.beta1, self.opt.beta2)
        shaped = pos + neg
        log_mean(ctx, "grpo_s/success_frac", success.double())
        log_mean(ctx, "grpo_s/shaped_reward", shaped)
        return rl_math.group_advantages(shaped, G, self.a.adv_std, self.a.adv_eps, self.a.adv_scope).to(batch.rewards.dtype)
