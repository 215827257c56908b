"""SAPO: Soft Adaptive Policy Optimization (Gao et al., 2025, arXiv 2511.20347, eq. (5)-(7)).

A smooth gate in place of the hard clip:
    r_i,t = pi / pi_old
    f(r)  = sigmoid(tau (r - 1)) * 4 / tau            f'(1) = 1: on-policy its gradient is GRPO's
    tau   = tau_pos if A_i > 0 else tau_neg           (paper/TRL/verl: 1.0 and 1.05)
    J     = 1/G sum_i 1/|o_i| sum_t f(r_i,t) A_i      seq-mean-token-mean; beta = 0
The gradient, f'(r) = 4 sigma (1 - sigma) r, fades smoothly as r leaves 1 instead of dropping to 0
at the clip bound; negative advantages fade faster (tau_neg > tau_pos).

Formulas, defaults and decisions: docs/algorithms.md, section sapo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import Algorithm, LossOutput, masked_stat
from grpo.foundation import rl_math
from grpo.foundation.config import positive


@dataclass
class SAPOOptions:
    tau_pos: float = positive(1.0, "a gate temperature; paper: 1.0 / 1.05")  # gate temperature where A > 0
    tau_neg: float = positive(1.05, "a gate temperature; paper: 1.0 / 1.05")  # gate temperature where A <= 0


class SAPO(Algorithm):
    name = "sapo"
    ratio_clip = False  # no PPO ratio clip: algo.delta does not apply
    paper = "SAPO, Soft Adaptive Policy Optimization (arXiv 2511.20347)"
    tag = "peer"
    summary = "sigmoid gate 4/tau sigmoid(tau (r - 1)) instead of the clip, tau by sign of A; seq-mean-token-mean"
    Options = SAPOOptions
    defaults = {"beta": 0.0, "aggregation": "seq-mean-token-mean", "adv_std": "unbiased", "adv_eps": 1e-4}
    knobs = ("tau_pos", "tau_neg", "num_iterations")

    def loss(self, logp: torch.Tensor, mb, norms: rl_math.StepNorms) -> LossOutput:
        ratio = rl_math.token_ratio(logp, self.old_logp(logp, mb))
        adv = self.token_advantages(mb)
        tau = torch.where(adv > 0, torch.full_like(adv, self.opt.tau_pos), torch.full_like(adv, self.opt.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
        zero = torch.zeros_like(logp)
        stats = {"clip_frac_low": masked_stat(zero, mb.mask), "clip_frac_high": masked_stat(zero, mb.mask),
                 "ratio_mean": masked_stat(ratio, mb.mask), "sapo/gate_mean": masked_stat(gate, mb.mask)}
        return self.token_pg_loss(-gate * adv, logp, mb, norms, stats)
