"""TIC-GRPO: trajectory-level importance-corrected GRPO (arXiv 2508.02833). [unverified]

Implemented as written in ALGORITHMS.md, not checked against the paper or code:
    w_i = exp(clamp(sum_t (l - l_old), -20, 20))          no length normalisation
    J   = 1/G sum_i min(w_i A_i, clip(w_i, 1 - eps_low, 1 + eps_high) A_i)
Options: ``upper_only_clip`` uses w~_i = min(w_i, 1 + eps_high) in place of the two-sided clip
(so J_i = min(w_i A_i, w~_i A_i)); ``length_corrected`` divides trajectory i's term by |o_i|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from algos.base import Algorithm, LossOutput
from grpo.foundation import core


@dataclass
class TICOptions:
    upper_only_clip: bool = False  # w~ = min(w, 1 + eps_high) instead of clip(w, 1 - eps_low, 1 + eps_high)
    length_corrected: bool = False  # divide trajectory i's term by |o_i|


class TICGRPO(Algorithm):
    name = "tic-grpo"
    paper = "TIC-GRPO, trajectory importance correction (arXiv 2508.02833)"
    tag = "unverified"
    summary = "trajectory ratio exp(sum Delta) (clamped at +-20), sequence-level clip"
    Options = TICOptions
    defaults = {"beta": 0.0, "clip_eps_low": 0.2, "clip_eps_high": 0.2, "aggregation": "seq-mean-token-mean"}
    knobs = ("clip_eps_low", "clip_eps_high", "upper_only_clip", "length_corrected")

    def loss(self, logp, mb, norms) -> LossOutput:
        ratio = core.trajectory_ratio(logp, self.old_logp(logp, mb), mb.mask)
        eps_low = math.inf if self.opt.upper_only_clip else None
        scale = 1.0 / mb.mask.sum(-1).clamp(min=1) if self.opt.length_corrected else None
        return self.sequence_ppo_loss(ratio, logp, mb, norms, eps_low=eps_low, scale=scale)
