"""GRPO-lambda: eligibility-trace credit assignment (arXiv 2510.00194). [unverified]

Implemented from the specification (docs/algorithms.md, "grpo-lambda"), not checked against
the paper's method section (not readable) or code:
    log rho~_{i,t} = sum_{k<=t} w_{t,k} m_{i,k} (l_{i,k} - l^old_{i,k})
    w_{t,k} = (gamma lambda)^(t-k)                                   trace = "recent" (default)
            = max((gamma lambda)^(t-k), (gamma lambda)^(k-1))         trace = "both" (k 1-based)
    A <- max(A, neg_adv_clamp) (-0.1), then GRPO's clipped surrogate with rho~.
lambda = 0.99, gamma = 1; the rest as GRPO. Even on-policy (rho~ = 1) the gradient of token t
carries the trace of the earlier tokens' log-probs.

From reviews and notes on the paper:
- "both" is written max((gamma lambda)^l, (gamma lambda)^(t-l)) with the lag l = t - k, i.e.
  (gamma lambda)^k with k counted from 0: the same weights as our 1-based (gamma lambda)^(k-1)
  (rl_math.eligibility_weights works 0-based).
- Reviewers report "both" did better than "recent"; gamma = 1 and which style is the paper's
  default are not confirmed. We keep trace = "recent" as the default, as the specification says.
- The paper's "epsilon-trace" and "epsilon-weight" variants are not implemented.
- The paper runs an SFT step before RL; this trainer does not (start from an SFT'd model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from algos.base import LossOutput
from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import ranged


@dataclass
class GRPOLambdaOptions:
    lam: float = ranged(0.99, "in (0, 1]")  # trace decay lambda
    gamma: float = ranged(1.0, "in (0, 1]")  # discount gamma
    trace: Literal["recent", "both"] = "recent"  # weighting of earlier tokens
    neg_adv_clamp: Optional[float] = ranged(-0.1, "<= 0", "or null")  # A <- max(A, this); null = no clamp


class GRPOLambda(GRPO):
    name = "grpo-lambda"
    paper = "GRPO-lambda, eligibility traces (arXiv 2510.00194)"
    tag = "unverified"
    summary = "log-ratio accumulated over earlier tokens with (gamma lambda)^(t-k), negative A clamped"
    Options = GRPOLambdaOptions
    knobs = ("lam", "gamma", "trace", "neg_adv_clamp")

    def advantages(self, batch, ctx) -> torch.Tensor:
        adv = super().advantages(batch, ctx)
        return adv if self.opt.neg_adv_clamp is None else adv.clamp(min=self.opt.neg_adv_clamp)

    def loss(self, logp, mb, norms) -> LossOutput:
        log_ratio = rl_math.trace_log_ratio(logp, self.old_logp(logp, mb), mb.mask,
                                         self.opt.gamma * self.opt.lam, self.opt.trace)
        per_token, stats = self.ppo_token_loss(logp, mb, torch.exp(log_ratio))
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)
