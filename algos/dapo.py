"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025, arXiv 2503.14476).

    l_i,t = min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)       clip-higher, eq. (10): 0.2 / 0.28
    J     = sum_i sum_t l_i,t / sum_i |o_i|                          token-mean, eq. (12); beta = 0
    dynamic sampling, eq. (11): groups whose rewards are all equal are dropped and further
        batches generated until the step holds ``rollout.prompts_per_step`` prompts (at most
        ``max_gen_batches`` generation batches, 0 = unlimited), then truncated to that size.
        ``filter_on``: the final reward (default), or the task reward before overlong shaping
        (as verl's DAPO recipe, which filters on accuracy)
    soft overlong punishment, eq. (13): r += R_len(|o|) (rewards/length.py), L_cache = overlong_buffer
        (default: L_max // 5, the paper's 4096 of L_max = 20480; 0 = off)
    overlong filtering (option): truncated completions (no EOS within L_max) get mask 0

Rows per rank stay equal: every rank keeps ``prompts_per_step / world`` groups; a rank that
found fewer valid groups than that takes the surplus of the others (in rank order).

Formulas, defaults and decisions: docs/algorithms.md, section dapo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from algos.base import StepContext, resample
from algos.grpo import GRPO
from grpo.foundation import rl_math, dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError, at_least_zero
from rewards.length import overlong_penalty


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling ran out of generation batches before the step was full."""


@dataclass
class DAPOOptions:
    dynamic_sampling: bool = True  # drop all-equal groups, refill
    filter_on: Literal["reward", "task_reward"] = "reward"  # task_reward: before overlong shaping
    max_gen_batches: int = at_least_zero(10, "0 = unlimited")  # generation batches per step, the first included; 0 = unlimited (verl: 10)
    overlong_buffer: Optional[int] = None  # L_cache; None: L_max // 5 (paper: 4096 of L_max = 20480); 0 = off
    overlong_factor: float = at_least_zero(1.0)  # scale of the overlong penalty
    overlong_filter: bool = False  # truncated completions get mask 0


def balance_groups(kept: Optional[RolloutBatch], quota: int) -> RolloutBatch:
    """Give every rank exactly ``quota`` groups from the ranks' kept groups (collective).

    Each rank keeps its own first groups; ranks with fewer than ``quota`` take, in rank
    order, the groups the other ranks have beyond their quota. The caller guarantees that
    the ranks hold at least ``quota * world`` groups together.
    """
    n = kept.num_groups if kept is not None else 0
    counts = dist.all_gather_object(n)
    own = kept.select_groups(list(range(min(n, quota)))) if n else None
    if min(counts) >= quota:
        return own
    surplus = kept.select_groups(list(range(quota, n))) if n > quota else None
    pool = [b for b in dist.all_gather_object(surplus) if b is not None]
    deficits = [max(0, quota - c) for c in counts]
    r = dist.rank()
    if deficits[r] == 0:
        return own
    merged = RolloutBatch.concat(pool)
    start = sum(deficits[:r])
    taken = merged.select_groups(list(range(start, start + deficits[r])))
    return taken if own is None else RolloutBatch.concat([own, taken])


class DAPO(GRPO):
    name = "dapo"
    paper = "DAPO (arXiv 2503.14476)"
    summary = "clip-higher, token-mean, dynamic sampling with refill, soft overlong punishment, no KL"
    Options = DAPOOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "clip_eps_low": 0.2, "clip_eps_high": 0.28, "aggregation": "token-mean"}
    knobs = ("clip_eps_low", "clip_eps_high", "dynamic_sampling", "max_gen_batches", "overlong_buffer",
             "overlong_filter")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        o, L = cfg.algo.options, cfg.rollout.max_completion_length
        if o.overlong_buffer is not None and not 0 <= o.overlong_buffer <= L:
            raise ConfigError(
                f"algo.overlong_buffer={o.overlong_buffer} is invalid: it must lie in [0, "
                f"rollout.max_completion_length={L}] (the soft punishment window ends at L_max; "
                f"the paper uses 4096 of 20480); 0 turns the shaping off, null means L_max // 5"
            )

    @property
    def overlong_buffer(self) -> int:
        """L_cache: the configured one, or the paper's proportion L_max // 5."""
        b = self.opt.overlong_buffer
        return self.cfg.rollout.max_completion_length // 5 if b is None else b

    # ----------------------------------------------------------------- hooks
    def shape_rewards(self, batch: RolloutBatch) -> RolloutBatch:
        """r += R_len(|o|), logged as the reward term ``overlong``."""
        if self.overlong_buffer <= 0:
            return batch
        lengths = torch.tensor([len(c) for c in batch.completion_ids])
        pen = overlong_penalty(lengths, self.cfg.rollout.max_completion_length, self.overlong_buffer,
                               self.opt.overlong_factor).to(batch.rewards.dtype)
        batch.extra = {**batch.extra, "task_reward": batch.rewards}
        batch.rewards = batch.rewards + pen
        batch.reward_terms = {**batch.reward_terms, "overlong": pen}
        return batch

    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        batch = self.shape_rewards(batch)
        if self.opt.dynamic_sampling:
            batch = self.dynamic_sampling(batch, ctx)
        if self.opt.overlong_filter:
            batch.mask = batch.mask * (~batch.truncated.bool()).unsqueeze(1).to(batch.mask.dtype)
        return batch

    def dynamic_sampling(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        """Keep groups with differing rewards; generate more until the step holds its prompts."""
        target = self.cfg.rollout.prompts_per_step
        kept, rounds, full = resample(self.keep_valid(KeptGroups(), batch), ctx, lambda k: k.found >= target,
                                      lambda k, more: self.keep_valid(k, self.shape_rewards(more)),
                                      self.opt.max_gen_batches)
        if not full:
            raise DynamicSamplingError(
                f"{self.name} dynamic sampling: after {rounds} generation batches only {int(kept.found)} of the "
                f"{target} prompts per step (rollout.prompts_per_step) have completions with differing "
                f"rewards ({int(kept.generated)} prompts sampled). The tasks are too easy or too hard for the "
                f"policy: raise algo.max_gen_batches (0 = unlimited), or set algo.dynamic_sampling=false"
            )
        ctx.metrics["dapo/kept_frac"] = kept.found / kept.generated
        ctx.metrics["dapo/reward_generated_mean"] = kept.reward_sum / kept.rows  # the policy's, before filtering
        ctx.metrics["dapo/gen_batches"] = float(rounds)
        quota = target // dist.world_size()
        return balance_groups(RolloutBatch.concat(kept.batches) if kept.batches else None, quota)

    def keep_valid(self, kept: "KeptGroups", batch: RolloutBatch) -> "KeptGroups":
        """Add ``batch``'s groups with differing rewards to ``kept``; counts are over all ranks."""
        signal = batch.extra.get("task_reward", batch.rewards) if self.opt.filter_on == "task_reward" else batch.rewards
        groups = rl_math.valid_groups(signal, batch.group_size)
        if groups:
            kept.batches.append(batch.select_groups(groups))
        c = dist.all_reduce_sum(torch.tensor(
            [len(groups), batch.num_groups, float(batch.rewards.double().sum()), len(batch)], dtype=torch.float64))
        kept.found += float(c[0])
        kept.generated += float(c[1])
        kept.reward_sum += float(c[2])
        kept.rows += float(c[3])
        return kept


@dataclass
class KeptGroups:
    """Dynamic sampling's harvest so far; the counts are over all ranks."""

    batches: list[RolloutBatch] = field(default_factory=list)
    found: float = 0.0  # groups with differing rewards
    generated: float = 0.0  # groups generated
    reward_sum: float = 0.0
    rows: float = 0.0
