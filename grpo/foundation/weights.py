"""Mixing weights: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref (reference sync with mixup, ``ref.mixup_alpha``)."""

from __future__ import annotations

import torch


@torch.no_grad()
def mix_(ref: torch.Tensor, theta: torch.Tensor, alpha: float) -> None:
    """ref <- alpha * theta + (1 - alpha) * ref in place (reference sync with mixup), computed in float32 (float64
    stays float64) and rounded once to ref's dtype; alpha = 1 copies theta exactly."""
    if alpha == 1.0:
        ref.copy_(theta)
        return
    acc = torch.float64 if ref.dtype == torch.float64 else torch.float32
    ref.copy_(theta.to(device=ref.device, dtype=acc) * alpha + ref.to(acc) * (1.0 - alpha))


@torch.no_grad()
def mix_state_(ref: dict[str, torch.Tensor], theta: dict[str, torch.Tensor], alpha: float) -> None:
    """``mix_`` over a state dict, each stored tensor once (tied weights share storage: mixed twice they would
    not follow the formula). Every key of ``ref`` must be in ``theta``."""
    missing = [k for k in ref if k not in theta]
    if missing:
        raise RuntimeError(f"reference sync: the policy's weights lack {missing[:5]} (of {len(missing)})")
    seen: set[int] = set()
    for k, v in ref.items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        mix_(v, theta[k], alpha)
