"""BNPO as TRL names it (``loss_type="bnpo"``): GRPO's clipped surrogate, token-mean.

    J = sum_i sum_t min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) / sum_i |o_i|

TRL divides by the tokens of the local (per-device) batch, so its gradient changes with
per_device_train_batch_size and the number of devices. Ours divides by the tokens of the whole step
(all micro-batches, all ranks), so the gradient does not depend on the split; it equals TRL's when
the step is one batch on one device. That makes it dapo's loss with dapo's clip-higher, dynamic
sampling and overlong shaping left out.

Formulas, defaults and decisions: docs/algorithms.md, section bnpo.
"""

from __future__ import annotations

from algos.grpo import GRPO


class BNPO(GRPO):
    name = "bnpo"
    paper = "TRL loss_type=bnpo (token-mean GRPO)"
    tag = "peer"
    summary = "GRPO's clipped surrogate, token-mean over the whole step (TRL: over the local batch); no KL"
    defaults = {**GRPO.defaults, "beta": 0.0, "aggregation": "token-mean"}
