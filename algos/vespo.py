"""VESPO: Variational Sequence-level Soft Policy Optimization (arXiv 2602.10693).

A Gamma-shaped weight of the sequence's importance ratio instead of a clip:
    log w_i = clamp(sum_t clamp(l - l_old, -20, 20), log 1e-8, 20)      the sum, not GSPO's mean
    phi_i   = exp(lambda + k log w_i - lambda w_i)  = e^lambda w^k e^(-lambda w),   phi(1) = 1
    (k, lambda) = (k_pos, lambda_pos) = (2, 3) if A_i >= 0, else (k_neg, lambda_neg) = (3, 2)
    J       = sum_i sum_t sg[phi_i] A_i log pi_i,t / sum_i |o_i|          token-mean over the step
phi is detached: it only scales each sequence's REINFORCE gradient. phi peaks at w = k / lambda and
falls to 0 for w -> 0 and w -> inf. Equal to TRL's ``loss_type="vespo"`` (beta = 0).

Formulas, defaults and decisions: docs/algorithms.md, section vespo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import rl_math
from grpo.foundation.config import positive

LOG_W_MIN = math.log(1e-8)


PAPER = "paper: k_pos 2, lambda_pos 3, k_neg 3, lambda_neg 2"


@dataclass
class VESPOOptions:
    k_pos: float = positive(2.0, PAPER)  # power of w where A >= 0
    lambda_pos: float = positive(3.0, PAPER)  # decay of w where A >= 0
    k_neg: float = positive(3.0, PAPER)  # power of w where A < 0
    lambda_neg: float = positive(2.0, PAPER)  # decay of w where A < 0


def gamma_weight(log_w: torch.Tensor, k: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """phi(w) = e^lam w^k e^(-lam w), from log w (non-finite values become 0)."""
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class VESPO(Algorithm):
    name = "vespo"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    token_level_pg = False  # one weight per sequence (TRL folds its own IS correction into w; ours has none)
    paper = "VESPO (arXiv 2602.10693)"
    tag = "peer"
    summary = "REINFORCE weighted by a detached Gamma-shaped function of the sequence IS ratio; token-mean"
    Options = VESPOOptions
    defaults = {"beta": 0.0, "aggregation": "token-mean", "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("k_pos", "lambda_pos", "k_neg", "lambda_neg", "num_iterations")

    def loss(self, logp: torch.Tensor, mb, norms: rl_math.StepNorms) -> LossOutput:
        adv = mb.advantages
        if adv.dim() != 1:
            raise ValueError(f"{self.name}: the sequence weight needs one advantage per completion")
        delta = (logp - self.old_logp(logp, mb)).detach().clamp(-20.0, 20.0)
        log_w = ((delta * mb.mask).sum(-1)).clamp(LOG_W_MIN, 20.0)
        pos = adv >= 0
        o = self.opt
        k = torch.where(pos, torch.full_like(log_w, o.k_pos), torch.full_like(log_w, o.k_neg))
        lam = torch.where(pos, torch.full_like(log_w, o.lambda_pos), torch.full_like(log_w, o.lambda_neg))
        phi = gamma_weight(log_w, k, lam)
        rows = torch.ones_like(phi)
        zero = torch.zeros_like(phi)
        stats = {"clip_frac_low": masked_stat(zero, rows), "clip_frac_high": masked_stat(zero, rows),
                 "ratio_mean": masked_stat(torch.exp(log_w), rows), "vespo/phi_mean": masked_stat(phi, rows)}
        return self.token_pg_loss(-(phi * adv).unsqueeze(-1) * logp, logp, mb, norms, stats)
