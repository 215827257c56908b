"""KL-Cov: "The Entropy Mechanism of RL for Reasoning LMs" (Cui et al., 2025, arXiv 2505.22617, sec. 4).

    cov_t = (A_t - mean A)(l_t - mean l)                 over every token of the step, l = the old policy's
    K     = the max(1, int(r N)) tokens with the largest cov_t   (r = 2e-4, N = tokens of the step)
    L_t   = -rho_t A_t + [t in K] kl_coef |l_t - l_old,t|        no clip at all (rho = pi / pi_old)
    loss  = token-mean of L
verl's ``policy_loss.loss_mode=kl_cov``, except that K is the whole step's top share (all ranks), not
each micro-batch's, so the gradient does not depend on the split; cov uses the old policy's l (equal
to the current one on the first pass).

Formulas, defaults and decisions: docs/algorithms.md, section kl-cov.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import LossOutput, masked_stat
from algos.grpo import GRPO
from grpo.foundation import rl_math, dist
from grpo.foundation.config import at_least_zero, ranged


@dataclass
class KLCovOptions:
    cov_ratio: float = ranged(2e-4, "in (0, 1]", "verl: 0.0002")  # share of the step's tokens that get the KL penalty
    kl_coef: float = at_least_zero(1.0, "default 1; verl's ppo_kl_coef defaults to 0.1")  # weight of |l - l_old| on them (verl: ppo_kl_coef, default 0.1 there)


class KLCov(GRPO):
    name = "kl-cov"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "KL-Cov, The Entropy Mechanism of RL (arXiv 2505.22617)"
    tag = "peer"
    summary = "unclipped ratio loss; the tokens with the largest cov(A, log pi) get a |log ratio| penalty"
    Options = KLCovOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("cov_ratio", "kl_coef")

    @property
    def needs_old_logprobs(self) -> bool:
        return True

    def advantages(self, batch, ctx) -> torch.Tensor:
        adv = super().advantages(batch, ctx)
        cov = rl_math.token_covariance(adv, batch.old_logp, batch.mask)
        tokens = int(dist.all_reduce_sum(batch.mask.double().sum().reshape(1))[0])
        top = rl_math.global_top_k_mask(cov, batch.mask, max(1, int(tokens * self.opt.cov_ratio)))
        batch.extra = {**batch.extra, "cov_top": top.to(batch.mask.dtype)}
        return adv

    advantages.uses_scores = True  # type: ignore[attr-defined]

    def loss(self, logp, mb, norms) -> LossOutput:
        old = self.old_logp(logp, mb)
        ratio = rl_math.token_ratio(logp, old)
        pg = -ratio * self.token_advantages(mb) + self.opt.kl_coef * (logp - old).abs() * mb.extra["cov_top"]
        zero = torch.zeros_like(logp)
        stats = {"clip_frac_low": masked_stat(zero, mb.mask), "clip_frac_high": masked_stat(zero, mb.mask),
                 "ratio_mean": masked_stat(ratio, mb.mask), "cov/penalised_frac": masked_stat(mb.extra["cov_top"], mb.mask)}
        return self.token_pg_loss(pg, logp, mb, norms, stats)
