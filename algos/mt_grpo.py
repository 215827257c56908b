"""MT-GRPO: turn-level credit assignment for multi-turn tool use (arXiv 2505.11821) [code].

Needs multi-turn rollouts (``env.name``): per trajectory i a turn reward R^T_i and an outcome reward
R^O_i (the environment's reward terms ``algo.turn_reward`` and ``algo.outcome_reward``; the built-in
calculator names them ``turn`` and ``outcome``), each normalised within its group (Bessel std, eps):

    Â^T_i = (R^T_i - mean_g R^T) / (std_g R^T + eps)        Â^O_i likewise
    A_i,t = Â^O_i + λ Â^T_i    on the tokens of the first assistant turn (before the first environment result)
    A_i,t = Â^O_i              on later assistant tokens
    A_i,t = Â^{T+O}_i          on every token of a trajectory with no environment result
                               (R^T + R^O normalised within the group)

Environment/tool tokens are out of the loss, the KL and the entropy (the batch's mask). λ = 1.
Loss: GRPO's clipped surrogate, token-mean. Paper defaults: G = 21, μ = 2, β = 0, ε = 0.2, lr 1e-6.

Formulas, defaults and decisions: docs/algorithms.md, section mt-grpo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import StepContext
from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.batch import RolloutBatch


@dataclass
class MTGRPOOptions:
    turn_coef: float = 1.0  # λ
    turn_reward: str = "turn"  # the environment's reward term that is R^T
    outcome_reward: str = "outcome"  # ... and R^O


def needs_turns(name: str, batch: RolloutBatch) -> None:
    if batch.turns is None:
        raise ValueError(f"{name} needs multi-turn rollouts: set env.name (e.g. env.name=calculator); "
                         "this batch is single-turn")


class MTGRPO(GRPO):
    name = "mt-grpo"
    paper = "MT-GRPO (arXiv 2505.11821)"
    tag = "code"
    summary = "multi-turn: first-turn tokens get Â^O + λ·Â^T, later ones Â^O; environment tokens masked"
    multi_turn = True
    Options = MTGRPOOptions
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean", "num_iterations": 2}
    knobs = ("turn_coef", "clip_eps_low", "clip_eps_high", "num_iterations")

    def advantages(self, batch: RolloutBatch, ctx: StepContext) -> torch.Tensor:
        needs_turns(self.name, batch)
        o = self.opt
        for key in (o.turn_reward, o.outcome_reward):
            if key not in batch.reward_terms:
                raise ValueError(f"mt-grpo: the environment reports no reward term {key!r} (it has "
                                 f"{sorted(batch.reward_terms)}); set algo.turn_reward / algo.outcome_reward")
        G, std, eps = batch.group_size, self.a.adv_std, self.a.adv_eps
        rt, ro = batch.reward_terms[o.turn_reward].double(), batch.reward_terms[o.outcome_reward].double()
        a_t = rl_math.group_advantages(rt, G, std, eps)
        a_o = rl_math.group_advantages(ro, G, std, eps)
        a_to = rl_math.group_advantages(rt + ro, G, std, eps)
        adv = torch.zeros(len(batch), batch.width, dtype=torch.float64)
        for i, turns in enumerate(batch.turns):
            if not any(t.obs_end > t.end for t in turns):  # no environment result: one advantage
                adv[i] = a_to[i]
                continue
            first_end = turns[0].end
            adv[i] = a_o[i]
            adv[i, :first_end] = a_o[i] + o.turn_coef * a_t[i]
        return (adv * batch.mask.double()).to(batch.mask.dtype)
