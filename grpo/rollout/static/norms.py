"""RMSNorm in each family's flavour (the static step's one norm: ``ModelSpec.norm`` and the layers call it)."""

from __future__ import annotations

from typing import Optional

import torch


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, gemma: bool = False,
             f32: str = "") -> torch.Tensor:
    """RMSNorm in float32 times ``weight``: cast first (Llama's), or ``1 + weight`` in float32 (``gemma``: Gemma 1-3,
    Qwen3.5), or ``weight`` in float32 with the inverse RMS by ``f32`` = "pow" (Gemma 3n and 4, whose value norms have
    no weight) or "rsqrt" (OLMo 2 and 3)."""
    h = x.float()
    if f32 == "pow":
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return (h if weight is None else h * weight.float()).to(x.dtype)
    if f32:  # OLMo: the weight times the float32 normed input, in their promoted dtype
        return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:  # Llama 4's L2 norm of queries and keys
        return h.to(x.dtype)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)
