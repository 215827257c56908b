"""lambda-GRPO: "GRPO is Secretly a Process Reward Model" (arXiv 2509.21154), authors' code.

Completions of a group that share a prefix form a prefix tree; GRPO's per-token term on a shared
prefix lambda is counted |lambda| times. lambda-GRPO divides it out:
    L_{i,t} / |lambda(i,t)|,  |lambda(i,t)| = #completions in the group whose first t tokens equal o_{i,<=t}
(duplicates count, i included). The aggregation's denominators stay token counts; the rest is
GRPO (group advantage, clip 0.2, k3 KL beta 0.04, seq-mean-token-mean).

Formulas, defaults and decisions: docs/algorithms.md, section lambda-grpo.
"""

from __future__ import annotations

from algos.base import LossOutput, masked_stat
from algos.grpo import GRPO
from grpo.foundation import rl_math


class LambdaGRPO(GRPO):
    name = "lambda-grpo"
    paper = "lambda-GRPO, GRPO is a process reward model (arXiv 2509.21154)"
    tag = "code"
    summary = "per-token loss divided by the number of group members sharing the prefix"

    def process_batch(self, batch, ctx):
        batch.extra["prefix_count"] = rl_math.prefix_counts(batch.completion_ids, batch.group_size, batch.width)
        return batch

    def loss(self, logp, mb, norms) -> LossOutput:
        per_token, stats = self.ppo_token_loss(logp, mb)
        counts = mb.extra["prefix_count"].to(logp.dtype).clamp(min=1)
        stats["prefix_count_mean"] = masked_stat(counts, mb.mask)
        return LossOutput(rl_math.aggregate(per_token / counts, mb.mask, self.a.aggregation, norms), stats)
