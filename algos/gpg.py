"""GPG: Group Policy Gradient (Chu et al., 2025, arXiv 2504.02546; authors' code AMAP-ML/GPG).

    A_i   = (r_i - mean_g r) / F_norm                F_norm = 1 (algo.adv_std=none); option: the std
    alpha = B / (B - M)                              B groups in the step, M with all-equal rewards
                                                     (both counted over all ranks)
    L     = -alpha * sum_i sum_t l_i,t A_i / sum_i |o_i|   plain policy gradient: no ratio, no clip,
                                                            no reference
The step is skipped (on every rank alike) when B = M. Threshold resampling (option, paper
beta_th = 0.6): while (B - M) / B < ``threshold``, generate further batches and put their
valid groups in place of this rank's uniform ones (at most ``max_gen_batches`` batches, the
first included; 0 = unlimited); then go on with what there is.

Formulas, defaults and decisions: docs/algorithms.md, section gpg.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import Algorithm, LossOutput, StepContext, masked_stat, resample
from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError, at_least_zero, ranged


@dataclass
class GPGOptions:
    threshold: float = ranged(0.0, "in [0, 1]", "paper: 0.6, 0 = off")  # beta_th: resample while the valid-group fraction is below it (paper: 0.6; 0 = off)
    max_gen_batches: int = at_least_zero(10, "0 = unlimited")  # generation batches per step for resampling, the first included; 0 = unlimited


class GPG(Algorithm):
    name = "gpg"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "GPG (arXiv 2504.02546)"
    tag = "code"
    summary = "plain policy gradient on r - mean_g r, scaled by alpha = B/(B-M); no ratio, clip or reference"
    Options = GPGOptions
    defaults = {"beta": 0.0, "adv_std": "none", "adv_eps": 1e-4, "aggregation": "token-mean"}
    knobs = ("adv_std", "threshold", "max_gen_batches")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.alpha = 1.0

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.algo.beta != 0:
            raise ConfigError(
                f"algo.beta={cfg.algo.beta} is invalid for gpg: it has no reference model, set algo.beta=0"
            )

    @property
    def needs_old_logprobs(self) -> bool:
        return self.a.kl_in_reward > 0  # no ratio; KL in the reward needs l_old

    @staticmethod
    def group_counts(batch: RolloutBatch) -> tuple[float, float]:
        """(B, M) over all ranks."""
        uniform = rl_math.uniform_groups(batch.rewards, batch.group_size)
        c = dist.all_reduce_sum(torch.tensor([uniform.numel(), uniform.sum()], dtype=torch.float64))
        return float(c[0]), float(c[1])

    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        def enough(b: RolloutBatch) -> bool:
            if self.opt.threshold <= 0:
                return True
            B, M = self.group_counts(b)
            return (B - M) / B >= self.opt.threshold

        batch, rounds, _ = resample(batch, ctx, enough, self.replace_uniform_groups, self.opt.max_gen_batches)
        B, M = self.group_counts(batch)
        ctx.metrics["gpg/gen_batches"] = float(rounds)
        ctx.metrics["gpg/valid_group_frac"] = (B - M) / B
        if B == M:  # no group carries a signal on any rank: skip the step everywhere
            ctx.skip_update = True
            self.alpha = float("nan")
        else:
            self.alpha = B / (B - M)
            ctx.metrics["gpg/alpha"] = self.alpha
        return batch

    @staticmethod
    def replace_uniform_groups(batch: RolloutBatch, more: RolloutBatch) -> RolloutBatch:
        """This rank's uniform groups, in order, give way to ``more``'s valid groups, in order."""
        n = batch.num_groups
        fresh = [n + g for g in rl_math.valid_groups(more.rewards, more.group_size)]
        good = set(rl_math.valid_groups(batch.rewards, batch.group_size))
        groups = [g if g in good or not fresh else fresh.pop(0) for g in range(n)]
        return RolloutBatch.concat([batch, more]).select_groups(groups)

    def loss(self, logp: torch.Tensor, mb: RolloutBatch, norms: rl_math.StepNorms) -> LossOutput:
        per_token, stats = self.tis(-self.alpha * logp * self.token_advantages(mb), logp, mb)
        ratio = rl_math.token_ratio(logp, self.old_logp(logp, mb)).detach()  # 1 on-policy; logged only
        zero = torch.zeros_like(logp)
        stats.update({
            "clip_frac_low": masked_stat(zero, mb.mask),
            "clip_frac_high": masked_stat(zero, mb.mask),
            "ratio_mean": masked_stat(ratio, mb.mask),
        })
        return LossOutput(rl_math.aggregate(per_token, mb.mask, self.a.aggregation, norms), stats)
