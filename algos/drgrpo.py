"""Dr. GRPO: "Understanding R1-Zero-Like Training: A Critical Perspective" (Liu et al., 2025,
arXiv 2503.20783), sec. 3.2, "GRPO Done Right".

GRPO without its two normalisations that bias the optimisation:
    A_i = r_i - mean(r)                                              no division by std(r)
    J   = 1/(G L_max) sum_i sum_t min(rho A_i, clip(rho, 1-eps, 1+eps) A_i)   no 1/|o_i|
i.e. ``seq-mean-token-sum-norm`` with L_max = rollout.max_completion_length; beta = 0, eps = 0.2.
Same as TRL's ``loss_type="dr_grpo"`` with ``scale_rewards="none"``.

Formulas, defaults and decisions: docs/algorithms.md, section drgrpo.
"""

from __future__ import annotations

from algos.grpo import GRPO


class DrGRPO(GRPO):
    name = "drgrpo"
    paper = "Dr. GRPO, Understanding R1-Zero-Like Training (arXiv 2503.20783)"
    summary = "A = r - mean (no std), token sum / (N * L_max) (no 1/|o|), no KL"
    defaults = {**GRPO.defaults, "beta": 0.0, "adv_std": "none", "aggregation": "seq-mean-token-sum-norm"}
    knobs = ("clip_eps_low", "clip_eps_high", "adv_std", "aggregation")
