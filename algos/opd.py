"""On-policy distillation: the student learns on its own samples, each token scored by a teacher.

GKD (Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes", ICLR 2024,
arXiv 2306.13649): train on the student's own samples against a teacher, token by token; with the reverse KL as the
divergence the objective is KL(pi_student || pi_teacher) on the student's tokens. Thinking Machines' "On-Policy
Distillation" (2025) trains it as reinforcement learning: the per-token reverse KL is a dense reward with discount 0,
optimised by importance-sampled policy gradient, which is what this file does:

    A_t = -coef * (log pi_old(o_t | x, o_<t) - log pi_teacher(o_t | x, o_<t))     per token; no task reward
    l_t = min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)                         rho_t = pi / pi_old
    J   = token-mean of l_t

The distillation term is the one any token-level algorithm takes when ``teacher`` names a teacher
(rl_math.distilled_advantages, added in prepare_loss; slime's form A_t - coef * (log pi_s - log pi_t)_t); opd is that
term alone: its task advantage is 0, so reward functions, when given, are scored and logged but not trained on.
Formulas, defaults and decisions: docs/algorithms.md, section opd; docs/distillation.md.
"""

from __future__ import annotations

import torch

from algos.grpo import GRPO
from grpo.foundation.config import ConfigError
from grpo.foundation.config_rules import distilling


class OPD(GRPO):
    name = "opd"
    tag = "peer"  # the form of slime's --use-opd and Thinking Machines' recipe (docs/algorithms.md, section opd)
    paper = "GKD (arXiv 2306.13649); Thinking Machines, On-Policy Distillation (2025)"
    summary = "per-token reverse KL to a teacher as the advantage (no task reward), token ratio, token-mean"
    defaults = {"beta": 0.0, "clip_eps_low": 0.2, "clip_eps_high": 0.2, "aggregation": "token-mean"}
    knobs = ("clip_eps_low", "clip_eps_high", "num_iterations")
    group_relative = False  # one sample per prompt is enough: the teacher scores every token
    learns_from_rewards = False  # rewards: [] is allowed (no reward metrics then)

    @classmethod
    def check_capabilities(cls, cfg) -> None:
        super().check_capabilities(cfg)
        if not distilling(cfg):
            raise ConfigError("opd learns from a teacher, and none is named: set teacher.model (an HF folder, in the "
                              "trainer's process) or teacher.url (a ref_client.py server on the teacher model), with "
                              f"teacher.coef > 0 (now {cfg.teacher.coef}); see docs/distillation.md")

    def advantages(self, batch, ctx) -> torch.Tensor:
        """0 on every token: the advantage is the teacher's term alone, added next (prepare_loss -> distill)."""
        return torch.zeros_like(batch.mask)
