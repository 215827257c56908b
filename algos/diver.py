"""DIVER: diversity-incentivized exploration (Hu et al., arXiv 2509.26209), as in the authors' code.

Correct completions (r >= correct_threshold) get a diversity bonus, then GRPO runs on
    r'_i = r_i + lambda * clip(D_i, 0, sigma)
D = td: TD(o_i) = 1/(G-1) sum_{j != i} (1 - BLEU_sym(o_i, o_j))      sigma = 0.91
    ed: ED(o_i) = |F(o_i) \\ U_{j != i} F(o_j)| / |F(o_i)|             sigma = 0.68
    mix: clip(TD, 0, 0.91) + clip(ED, 0, 0.42)
(BLEU: whitespace tokens, 1-5-gram weights of the authors' code, first ``max_chars`` characters;
see rewards/diversity.py). Decision: lambda = 0.1 (the paper sweeps 0.001-1). ``decay_steps`` > 0
gives the bonus only for the first that many steps (the authors' code: 100). The spec names no
default measure: ``td`` here. ``reward/*`` metrics keep the task reward; the bonus is logged.

Formulas, defaults and decisions: docs/algorithms.md, section diver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from algos.base import log_mean
from algos.grpo import GRPO
from grpo.foundation import rl_math
from grpo.foundation.config import at_least_zero, positive, ranged
from rewards.diversity import BLEU_WEIGHTS, equational_diversity, textual_diversity


@dataclass
class DiverOptions:
    diversity: Literal["td", "ed", "mix"] = "td"  # textual, equational, or both
    lam: float = at_least_zero(0.1)  # bonus weight (Decision; swept 0.001-1 in the paper)
    td_cap: float = at_least_zero(0.91)  # sigma for td (also td's cap inside mix)
    ed_cap: float = at_least_zero(0.68)  # sigma for ed
    mix_ed_cap: float = at_least_zero(0.42)  # ed's cap inside mix
    correct_threshold: float = 1.0  # only completions with r >= this get the bonus
    decay_steps: int = at_least_zero(0)  # > 0: bonus only for the first decay_steps steps (authors' code: 100)
    max_chars: int = positive(1000)  # characters of each completion compared (authors' code: 1000)
    bleu_weights: list[float] = ranged(None, ">= 0", "one weight per n-gram order", factory=lambda: list(BLEU_WEIGHTS))  # 1..n-gram weights


class Diver(GRPO):
    name = "diver"
    paper = "DIVER, diversity-incentivized exploration (arXiv 2509.26209)"
    tag = "code"
    summary = "correct completions get a capped textual/equational diversity bonus, then GRPO"
    Options = DiverOptions
    knobs = ("diversity", "lam", "decay_steps")

    def diversity_bonus(self, texts: list[str], group_size: int) -> torch.Tensor:
        """clip(D, 0, sigma) per completion, group by group (before lambda and the correctness gate)."""
        o = self.opt
        out = []
        for g in range(0, len(texts), group_size):
            group = texts[g : g + group_size]
            td = torch.tensor(textual_diversity(group, o.bleu_weights, o.max_chars), dtype=torch.float64)
            ed = torch.tensor(equational_diversity(group, o.max_chars), dtype=torch.float64)
            if o.diversity == "td":
                out.append(td.clamp(0, o.td_cap))
            elif o.diversity == "ed":
                out.append(ed.clamp(0, o.ed_cap))
            else:
                out.append(td.clamp(0, o.td_cap) + ed.clamp(0, o.mix_ed_cap))
        return torch.cat(out)

    def advantages(self, batch, ctx) -> torch.Tensor:
        correct = (batch.rewards >= self.opt.correct_threshold).double()
        if self.opt.decay_steps == 0 or ctx.step < self.opt.decay_steps:
            bonus = self.opt.lam * self.diversity_bonus(batch.completion_text, batch.group_size) * correct
        else:
            bonus = torch.zeros_like(correct)
        shaped = batch.rewards.double() + bonus
        log_mean(ctx, "diver/bonus", bonus)
        log_mean(ctx, "diver/bonus_correct", bonus, correct)
        adv = rl_math.group_advantages(shaped, batch.group_size, self.a.adv_std, self.a.adv_eps, self.a.adv_scope)
        return adv.to(batch.rewards.dtype)
