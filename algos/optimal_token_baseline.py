"""Optimal Token Baseline (verl's ``adv_estimator=optimal_token_baseline``; arXiv 2602.07078): a baseline
per token position and prompt group, weighted by each completion's accumulated "realized energy".

    G_i,t = sum_{k >= t} r_i,k                       return-to-go of the token rewards (outcome - KL-in-reward)
    w_i,t = 1 - 2 pi_old(o_t) + sum_v pi_old(v)^2    the squared norm of the logit gradient of token t
                                                     (times min(pi_old / pi_sampler, C)^2 with algo.tis_cap)
    W_i,t = sum_{k <= t} w_i,k
    B_g,t = sum_{j in g} G_j,t W_j,t / (sum_{j in g} W_j,t + 1e-8)   over the group's rows that reach t
    A_i,t = G_i,t - B_g,t                            (zero_tail: B = 0 where only the longest row reaches t)
    loss: GRPO's clipped surrogate with token advantages, token-mean; beta = 0
The old-policy pass computes sum_v pi^2 next to the log-probs (grpo.foundation.logprobs, ``sum_pi_squared``).

Formulas, defaults and decisions: docs/algorithms.md, section optimal-token-baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import Config, ConfigError


@dataclass
class OptimalTokenBaselineOptions:
    zero_tail: bool = True  # verl's handle_zero_tail: no baseline where only the group's longest row reaches


class OptimalTokenBaseline(GRPO):
    name = "optimal-token-baseline"
    paper = "Optimal Token Baseline, OTB (arXiv 2602.07078)"
    tag = "peer"
    summary = "per-token group baseline of returns weighted by accumulated 1 - 2 pi + sum pi^2; token-mean, no KL"
    Options = OptimalTokenBaselineOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("zero_tail", "kl_in_reward")
    needs_sum_pi_squared = True

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.env.name:
            raise ConfigError(f"optimal-token-baseline lines up the tokens of a group's completions by position; "
                              f"env.name={cfg.env.name!r} rolls out multi-turn trajectories (observations between "
                              f"the policy's tokens): unset env.name or choose grpo / rloo")

    @property
    def needs_old_logprobs(self) -> bool:
        return True  # pi_old(o_t) and sum_v pi_old(v)^2 before the advantages

    def advantages(self, batch, ctx) -> torch.Tensor:
        G, mask = batch.group_size, batch.mask.double()
        returns = rl_math.discounted_returns(self.token_rewards(batch, ctx), batch.mask)
        w = 1 - 2 * batch.old_logp.double().exp() + batch.extra["sum_pi_squared"].double()
        if self.a.tis_cap is not None and batch.sampler_logp is not None:
            w = w * rl_math.tis_weight(batch.old_logp, batch.sampler_logp, batch.mask, self.a.tis_cap).double() ** 2
        W = (w * mask).cumsum(-1)
        T = mask.shape[1]
        num = (returns * W * mask).view(-1, G, T).sum(1)  # [groups, T]
        den = (W * mask).view(-1, G, T).sum(1) + 1e-8
        baseline = (num / den).repeat_interleave(G, dim=0)  # [rows, T]
        if self.opt.zero_tail:
            lengths = rl_math.group_view(batch.mask.sum(-1), G)  # [groups, G]
            top2 = lengths.topk(min(2, G), dim=1).values
            for g in range(lengths.shape[0]):
                longest = (lengths[g] == top2[g, 0]).nonzero().flatten()
                if G > 1 and len(longest) == 1 and top2[g, 0] > top2[g, 1]:
                    baseline[g * G + int(longest[0]), int(top2[g, 1]):] = 0.0
        return ((returns - baseline) * mask).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
