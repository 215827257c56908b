"""TIC-GRPO: trajectory-level importance-corrected GRPO (arXiv 2508.02833). [unverified]

Implemented from the specification (docs/algorithms.md, "tic-grpo"), not checked against the
paper (its method section was not readable); reviews confirm both options below exist:
    w_i = exp(clamp(sum_t m (l - l_old), -20, 20))          no length normalisation
    J   = 1/G sum_i min(w_i A_i, clip(w_i, 1 - eps_low, 1 + eps_high) A_i)
Options: ``upper_only_clip`` caps w from above only; ``length_corrected`` divides trajectory i's
term by |o_i|.

Decision (``upper_only_clip``, ambiguous in the paper): w~_i = min(w_i, 1 + eps_high) goes in
place of clip(w_i) *inside* the PPO min, J_i = min(w_i A_i, w~_i A_i), so for A_i < 0 the
unclipped w_i stays (as in the one public implementation). The other reading, replacing w_i by
w~_i (J_i = w~_i A_i), is not offered. Here ``sequence_ppo_loss`` gets eps_low = inf.
Known difference from that public implementation: it clamps each token's Delta before summing
and spreads w_i over the tokens with a token mean; ours clamps the sum and keeps 1/G sum_i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from algos.base import Algorithm, LossOutput
from grpo.foundation import rl_math


@dataclass
class TICOptions:
    upper_only_clip: bool = False  # min(w A, min(w, 1 + eps_high) A): upper cap only, inside the PPO min
    length_corrected: bool = False  # divide trajectory i's term by |o_i|


class TICGRPO(Algorithm):
    name = "tic-grpo"
    token_level_pg = False  # one ratio per sequence: algo.tis_cap does not apply
    paper = "TIC-GRPO, trajectory importance correction (arXiv 2508.02833)"
    tag = "unverified"
    summary = "trajectory ratio exp(sum Delta) (clamped at +-20), sequence-level clip"
    Options = TICOptions
    defaults = {"beta": 0.0, "clip_eps_low": 0.2, "clip_eps_high": 0.2, "aggregation": "seq-mean-token-mean"}
    knobs = ("clip_eps_low", "clip_eps_high", "upper_only_clip", "length_corrected")

    def loss(self, logp, mb, norms) -> LossOutput:
        ratio = rl_math.trajectory_ratio(logp, self.old_logp(logp, mb), mb.mask)
        eps_low = math.inf if self.opt.upper_only_clip else None
        scale = 1.0 / mb.mask.sum(-1).clamp(min=1) if self.opt.length_corrected else None
        return self.sequence_ppo_loss(ratio, logp, mb, norms, eps_low=eps_low, scale=scale)
