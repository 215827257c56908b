"""GTPO: token-level entropy-shaped rewards (Tan et al., "GTPO and GRPO-S", arXiv 2508.04349 v5).

Per group, O+ = completions with r >= success_threshold (n of them), O- the rest (m). At token t
(sums over the completions of that side still active at t; d_t, h_t = how many):
    r+_{i,t} = alpha1 r_i + alpha2 H_{i,t} / sum_{k in O+} H_{k,t} * d_t            i in O+, else 0
    r-_{j,t} = -alpha1 - alpha2 (1/H_{j,t}) / sum_{k in O-} (1/H_{k,t}) * h_t       j in O-, else 0
    A+ = (r+ - mean R+) / std R+,  A- likewise, over ALL completion tokens in scope, zeros included
    (Decision: without the zeros the outcome signal cancels); scope = batch (paper) or group.
Loss: grpo's clipped surrogate with A+ on O+ tokens and A- on O- tokens, token-mean, eps 0.2 / 0.28,
beta = 0. H is the old policy's full-vocabulary entropy (detached); 1/H uses max(H, 1e-6). The
std kind and its eps are ``algo.adv_std`` / ``algo.adv_eps``.

Formulas, defaults and decisions: docs/algorithms.md, section gtpo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from algos.base import log_mean
from algos.grpo import GRPO
from grpo.foundation import rl_math


@dataclass
class GTPOOptions:
    alpha1: float = 1.0  # weight of the outcome reward
    alpha2: float = 0.1  # weight of the entropy bonus
    success_threshold: float = 1.0  # r >= this is a success (the maximum of a 0/1 reward)
    scope: Literal["batch", "group"] = "batch"  # tokens the shaped rewards are standardised over


class GTPO(GRPO):
    name = "gtpo"
    paper = "GTPO, entropy-shaped token rewards (arXiv 2508.04349 v5)"
    summary = "token rewards shaped by the old policy's entropy, standardised per side, token-mean"
    Options = GTPOOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "clip_eps_high": 0.28, "aggregation": "token-mean"}
    knobs = ("alpha1", "alpha2", "success_threshold", "scope")

    @property
    def needs_entropy(self) -> bool:
        return True

    def advantages(self, batch, ctx) -> torch.Tensor:
        G, mask = batch.group_size, batch.mask
        success = batch.rewards >= self.opt.success_threshold
        pos, neg = rl_math.entropy_shaped_rewards(batch.rewards, batch.entropy, mask, success, G,
                                               self.opt.alpha1, self.opt.alpha2)
        adv_pos = rl_math.standardize(pos, mask, G, self.opt.scope, self.a.adv_std, self.a.adv_eps)
        adv_neg = rl_math.standardize(neg, mask, G, self.opt.scope, self.a.adv_std, self.a.adv_eps)
        log_mean(ctx, "gtpo/success_frac", success.double())
        log_mean(ctx, "gtpo/shaped_reward_pos", pos, mask * success.unsqueeze(-1))
        log_mean(ctx, "gtpo/shaped_reward_neg", neg, mask * (~success).unsqueeze(-1))
        adv = torch.where(success.unsqueeze(-1), adv_pos, adv_neg) * mask
        return adv.to(batch.rewards.dtype)
