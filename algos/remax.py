"""ReMax (Li et al., 2024, arXiv 2310.10505, Algorithm 1): REINFORCE with the greedy completion's reward
as the baseline.

    b_q  = r(q, greedy completion of q)         one extra greedy generation per prompt, scored alike
    A_i  = r_i - b_q                             on every token of completion i
    with algo.kl_in_reward = c > 0 (verl's ``compute_remax_outcome_advantage``): per token, the reward-to-go
    A_i,t = sum_{k >= t} (r_i [k = last] - c k1_i,k) - b_q,   k1 = l_old - l_ref; b_q without KL
    loss: GRPO's clipped surrogate, token-mean; beta = 0
Equal to verl's ``adv_estimator=remax`` (verl generates the greedy baseline in its trainer loop; here
``process_batch`` asks the rollout service for it). Any number of completions per prompt works (G >= 1).

Formulas, defaults and decisions: docs/algorithms.md, section remax.
"""

from __future__ import annotations

import torch

from algos.base import StepContext, log_mean
from grpo.foundation import rl_math
from algos.grpo import GRPO
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import Config, ConfigError


class ReMax(GRPO):
    name = "remax"
    paper = "ReMax (arXiv 2310.10505)"
    tag = "peer"
    summary = "baseline = reward of the prompt's greedy completion (one extra greedy generation per prompt)"
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
    knobs = ("kl_in_reward", "clip_eps_low", "clip_eps_high")
    group_relative = False

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.env.name:
            raise ConfigError(f"remax's greedy baseline is a single-turn completion; env.name={cfg.env.name!r} "
                              f"rolls out multi-turn trajectories: unset env.name or choose rloo / grpo")

    def process_batch(self, batch: RolloutBatch, ctx: StepContext) -> RolloutBatch:
        """Generate and score one greedy completion per prompt (collective: every rank calls generate)."""
        rows = list(range(0, len(batch), batch.group_size))
        greedy = batch.select(rows)
        rollout = ctx.rollout
        comp = rollout.generate([batch.prompt_ids[i] for i in rows], rollout.params.greedy(), n=1)
        greedy.completion_ids = comp.tokens
        greedy.completion_text = rollout.decode(comp.tokens)
        greedy.group_size = 1
        rollout.score(greedy)
        baseline = greedy.rewards.to(batch.rewards.dtype).repeat_interleave(batch.group_size)
        batch.extra = {**batch.extra, "remax_baseline": baseline}
        log_mean(ctx, "remax/baseline_reward", baseline)
        return batch

    def advantages(self, batch, ctx) -> torch.Tensor:
        baseline = batch.extra["remax_baseline"]
        if self.a.kl_in_reward <= 0:  # the reward-to-go is r_i on every token: one advantage per row
            return batch.rewards - baseline
        returns = rl_math.discounted_returns(self.token_rewards(batch, ctx), batch.mask)
        return (returns - baseline.double().unsqueeze(1) * batch.mask.double()).to(batch.rewards.dtype)

    advantages.uses_scores = True  # type: ignore[attr-defined]
