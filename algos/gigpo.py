"""GiGPO: group-in-group policy optimisation for multi-turn agents (arXiv 2505.10978) [code].

Needs multi-turn rollouts (``env.name``). A group is the N trajectories of one task (the G rows of a
prompt). With r_t the environment's step rewards (invalid-action penalties included) and
R(τ) = Σ_t r_t the episode return (the batch's reward):

    A^E(τ_i)   = (R(τ_i) - mean_j R(τ_j)) / F_norm                    episode level, over the group
    R_t        = Σ_{k>=t} γ^{k-t} r_k                                   discounted step return (γ = 0.95)
    anchor groups: every step of the group's trajectories (any trajectory, any t) whose observation
               is identical (exact match of the observation text)
    A^S_{i,t}  = (R_{i,t} - mean over its anchor group) / F_norm,  0 for a singleton group
    A_{i,t}    = A^E(τ_i) + ω A^S_{i,t}  on every token of step t's action (ω = 1)

F_norm = 1 (``mean_norm``, the default) or std + ε (``mean_std_norm``, Bessel std, ε = 1e-6).
``episode_stats: step`` takes the episode mean and std over the group's step rows (each trajectory
weighted by its number of steps: the reference code's default) instead of over its trajectories.
Loss: GRPO's clipped surrogate, token-mean, k3 KL with β = 0.01 (the paper's runs).

Formulas, defaults and decisions: docs/algorithms.md, section gigpo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from algos.base import StepContext
from algos.grpo import GRPO
from algos.mt_grpo import needs_turns
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import at_least_zero, ranged


@dataclass
class GiGPOOptions:
    gamma: float = ranged(0.95, "in [0, 1]")  # γ of the step returns
    step_coef: float = 1.0  # ω
    norm: Literal["mean_norm", "mean_std_norm"] = "mean_norm"  # F_norm: 1, or std + eps
    norm_eps: float = at_least_zero(1e-6)  # eps of mean_std_norm
    episode_stats: Literal["trajectory", "step"] = "trajectory"  # step: weighted by steps


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def _mean_std(values: list[float], weights: list[float]) -> tuple[float, float]:
    """Weighted mean and Bessel-corrected std (weights are repeat counts), in float64."""
    x = torch.tensor(values, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    n = w.sum()
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / (n - 1) if n > 1 else torch.zeros((), dtype=torch.float64)
    return float(mean), float(var.sqrt())


class GiGPO(GRPO):
    name = "gigpo"
    paper = "GiGPO (arXiv 2505.10978)"
    tag = "code"
    summary = "multi-turn: episode advantage + ω × anchor-state step advantage of discounted step returns"
    multi_turn = True
    Options = GiGPOOptions
    defaults = {**GRPO.defaults, "beta": 0.01, "aggregation": "token-mean"}
    knobs = ("gamma", "step_coef", "norm", "beta")

    def _scale(self, std: float) -> float:
        return 1.0 if self.opt.norm == "mean_norm" else std + self.opt.norm_eps

    def step_advantages(self, batch: RolloutBatch) -> tuple[list[float], list[list[float]], dict]:
        """(A^E per row, A^S per row and step, statistics) in float64."""
        o, G = self.opt, batch.group_size
        a_e, a_s = [0.0] * len(batch), [[0.0] * len(t) for t in batch.turns]
        rewards = batch.rewards.double().tolist()
        anchors, singletons, steps = 0, 0, 0
        for g in range(len(batch) // G):
            rows = list(range(g * G, (g + 1) * G))
            weights = [1.0] * G if o.episode_stats == "trajectory" else [float(len(batch.turns[i])) for i in rows]
            mean, std = _mean_std([rewards[i] for i in rows], weights)
            for i in rows:
                a_e[i] = (rewards[i] - mean) / self._scale(std)
            groups: dict[str, list[tuple[int, int, float]]] = {}
            for i in rows:
                ret = discounted_returns([t.reward for t in batch.turns[i]], o.gamma)
                for t, (turn, r_t) in enumerate(zip(batch.turns[i], ret)):
                    groups.setdefault(turn.state, []).append((i, t, r_t))
            for members in groups.values():
                steps += len(members)
                if len(members) == 1:
                    singletons += 1
                    continue  # A^S = 0
                anchors += 1
                m, s = _mean_std([r for _, _, r in members], [1.0] * len(members))
                for i, t, r in members:
                    a_s[i][t] = (r - m) / self._scale(s)
        return a_e, a_s, {"anchor_groups": anchors, "singleton_groups": singletons, "steps": steps}

    def advantages(self, batch: RolloutBatch, ctx: StepContext) -> torch.Tensor:
        needs_turns(self.name, batch)
        a_e, a_s, stats = self.step_advantages(batch)
        adv = torch.zeros(len(batch), batch.width, dtype=torch.float64)
        for i, turns in enumerate(batch.turns):
            for t, turn in enumerate(turns):
                adv[i, turn.start:turn.end] = a_e[i] + self.opt.step_coef * a_s[i][t]
        if ctx is not None and ctx.metrics is not None:
            from grpo.foundation import dist

            s = dist.all_reduce_sum(torch.tensor([stats["anchor_groups"], stats["singleton_groups"], stats["steps"]],
                                                 dtype=torch.float64))
            ctx.metrics["gigpo/anchor_groups"] = float(s[0])
            ctx.metrics["gigpo/singleton_frac"] = float(s[1] / s[2].clamp(min=1))
            ctx.metrics["gigpo/anchor_group_size"] = float((s[2] - s[1]) / s[0].clamp(min=1))
        return (adv * batch.mask.double()).to(batch.mask.dtype)
