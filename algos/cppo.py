"""CPPO: Completion Pruning Policy Optimization (Lin et al., 2025, arXiv 2503.22342; code lzhxmu/CPPO).

After the GRPO advantages A_i are computed, keep per group the

    k = floor(G * (1 - P))

completions with the largest |A_i| (ties: the lowest index) and drop the rest before any
forward pass: old-policy, reference and policy passes all run on kept rows only. The loss is
grpo's clipped surrogate with k3 KL, aggregated ``token-mean`` over the kept tokens.
``scope: batch`` keeps the top floor(N * (1 - P)) rows of this rank's N rows instead (as the
authors' code, which prunes each process's slice; ranks keep equal row counts).
Dynamic allocation (option): sample ceil(b / (1 - P)) prompts instead of b (rounded up to a
multiple of the rank count) so that the update batch keeps about b * G rows.
Defaults (paper): G = 16, P = 0.5, beta = 0.04, mu = 2.

Formulas, defaults and decisions: docs/algorithms.md, section cppo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from algos.base import StepContext
from algos.grpo import GRPO
from grpo.foundation import dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError, ranged


@dataclass
class CPPOOptions:
    pruning: float = ranged(0.5, "in [0, 1)", "paper: 0.5")  # P: the fraction of completions dropped
    scope: Literal["group", "batch"] = "group"  # batch: the top rows of the rank's batch
    allocation: bool = False  # sample ceil(b / (1 - P)) prompts so the update batch keeps its size


def kept_count(n: int, pruning: float) -> int:
    """floor(n * (1 - P)), robust to float error (10 * (1 - 0.9) is 0.99999...)."""
    return math.floor(n * (1.0 - pruning) + 1e-9)


def top_abs(adv: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest |adv| (ties: lowest index), in increasing order."""
    order = torch.sort(adv.abs(), descending=True, stable=True).indices[:k]
    return sorted(order.tolist())


class CPPO(GRPO):
    name = "cppo"
    paper = "CPPO (arXiv 2503.22342)"
    tag = "code"
    summary = "grpo that keeps only the completions with the largest |A| per group; forward passes on kept rows"
    advantages_after_forward = False  # computed in process_batch, before pruning
    Options = CPPOOptions
    defaults = {**GRPO.defaults, "beta": 0.04, "aggregation": "token-mean", "num_iterations": 2}
    knobs = ("pruning", "scope", "allocation", "beta", "num_iterations")

    @classmethod
    def validate(cls, cfg: Config) -> None:
        P, G = cfg.algo.options.pruning, cfg.rollout.num_generations
        if cfg.algo.options.scope == "group" and kept_count(G, P) < 1:
            raise ConfigError(
                f"algo.pruning={P} keeps floor({G} * (1 - {P})) = 0 completions per group: lower it or raise "
                f"rollout.num_generations"
            )

    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        """Allocation, then advantages on every completion, then pruning: every forward pass of the
        step runs on the kept rows only; the step's reward and advantage metrics describe them all."""
        batch = self.allocate(batch, ctx)
        batch.advantages = self.advantages(batch, ctx)
        ctx.scored = batch
        return self.prune_batch(batch, ctx)

    def allocate(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        if not self.opt.allocation or self.opt.pruning == 0:
            return batch
        b, world = self.cfg.rollout.prompts_per_step, dist.world_size()
        total = math.ceil(b / (1.0 - self.opt.pruning) - 1e-9)
        total = -(-total // world) * world
        ctx.metrics["cppo/prompts"] = float(total)
        if total > b:
            batch = RolloutBatch.concat([batch, ctx.generate_more(total - b)])
        return batch

    def prune_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        adv, G = batch.advantages, batch.group_size
        if self.opt.scope == "group":
            k = kept_count(G, self.opt.pruning)
            rows = [g * G + j for g in range(batch.num_groups) for j in top_abs(adv[g * G : (g + 1) * G], k)]
            size = k
        else:
            rows = top_abs(adv, kept_count(len(batch), self.opt.pruning))
            size = 1  # the kept rows no longer form groups
        if not rows:
            raise ConfigError(f"algo.pruning={self.opt.pruning} keeps no row of this rank's {len(batch)}: lower it")
        kept = batch.select(rows)
        kept.group_size = size
        c = dist.all_reduce_sum(torch.tensor([len(kept), len(batch)], dtype=torch.float64))
        ctx.metrics["cppo/kept_frac"] = float(c[0] / c[1])
        return kept
