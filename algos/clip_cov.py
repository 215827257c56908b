"""Clip-Cov: "The Entropy Mechanism of RL for Reasoning LMs" (Cui et al., 2025, arXiv 2505.22617, sec. 4).

Tokens whose log-probability moves with the advantage (large covariance) drive the entropy down;
Clip-Cov takes a few of them out of the gradient:
    cov_t  = (A_t - mean A)(l_t - mean l)                 over every token of the step, l = the old policy's
    C      = {t : lb < cov_t < ub}                         candidates (lb = 1, ub = 5)
    D      = max(1, int(r N)) tokens drawn uniformly from C   (r = 2e-4, N = tokens of the step)
    loss   = token-mean of [t not in D] * -min(rho A, clip(rho, 1 - eps, 1 + eps) A)
verl's ``policy_loss.loss_mode=clip_cov``, except that the candidates, the count N and the draw are
the whole step's (all ranks, seeded by train.seed and the step), not each micro-batch's, so the gradient
does not depend on the split; l is the old policy's (equal to the current one on the first pass).

Formulas, defaults and decisions: docs/algorithms.md, section clip-cov.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import LossOutput, masked_stat
from algos.grpo import GRPO
from grpo.foundation import rl_math, dist
from grpo.foundation.config import Config, ConfigError, ranged


@dataclass
class ClipCovOptions:
    cov_ratio: float = ranged(2e-4, "in (0, 1]", "verl: 0.0002")  # share of the step's tokens taken out of the gradient
    cov_lb: float = 1.0  # candidates: lb < cov < ub
    cov_ub: float = 5.0  # upper bound of the candidates' centred covariance


class ClipCov(GRPO):
    name = "clip-cov"
    paper = "Clip-Cov, The Entropy Mechanism of RL (arXiv 2505.22617)"
    tag = "peer"
    summary = "PPO clip; a few random tokens with high cov(A, log pi) are taken out of the gradient; token-mean"
    Options = ClipCovOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("cov_ratio", "cov_lb", "cov_ub")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        o = cfg.algo.options
        if not o.cov_lb < o.cov_ub:
            raise ConfigError(f"algo.cov_lb={o.cov_lb} must be < algo.cov_ub={o.cov_ub} (verl: 1 and 5)")

    @property
    def needs_old_logprobs(self) -> bool:
        return True  # the covariance is taken with the old policy's log-probs, before the loss

    def advantages(self, batch, ctx) -> torch.Tensor:
        adv = super().advantages(batch, ctx)
        cov = rl_math.token_covariance(adv, batch.old_logp, batch.mask)
        cand = (cov > self.opt.cov_lb) & (cov < self.opt.cov_ub) & batch.mask.bool()
        flat = cand.reshape(-1)
        pos, total = rl_math.global_rank_positions(flat)
        tokens = int(dist.all_reduce_sum(batch.mask.double().sum().reshape(1))[0])
        k = min(max(int(self.opt.cov_ratio * tokens), 1), total)
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + ctx.step)
        chosen = torch.zeros(total, dtype=torch.bool)
        chosen[torch.randperm(total, generator=g)[:k]] = True
        drop = torch.zeros_like(flat)
        drop[flat.nonzero(as_tuple=True)[0]] = chosen[pos]
        batch.extra = {**batch.extra, "cov_drop": drop.reshape(cand.shape).to(batch.mask.dtype)}
        return adv

    advantages.uses_scores = True  # type: ignore[attr-defined]

    def loss(self, logp, mb, norms) -> LossOutput:
        per_token, stats = self.ppo_token_loss(logp, mb, weight=1.0 - mb.extra["cov_drop"])
        stats["cov/dropped_frac"] = masked_stat(mb.extra["cov_drop"], mb.mask)
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)

