"""Length-based reward terms.

DAPO's soft overlong punishment (Yu et al., 2025, arXiv 2503.14476, eq. 13), with
L_cache = ``buffer`` and L_max = ``max_len`` (the whole generation budget, cache included):

    R_len(|o|) = 0                                   |o| <= L_max - L_cache
               = ((L_max - L_cache) - |o|) / L_cache  L_max - L_cache < |o| <= L_max
               = -1                                  |o| > L_max

times ``factor`` (default 1). This is the one implementation; DAPO, ProRL and any reward
function that penalises overlong completions use it.
"""

from __future__ import annotations

from typing import Union, overload

import torch


@overload
def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float: ...
@overload
def overlong_penalty(length: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor: ...


def overlong_penalty(
    length: Union[int, torch.Tensor], max_len: int, buffer: int, factor: float = 1.0
) -> Union[float, torch.Tensor]:
    """R_len for one length (float) or a tensor of lengths (float64 tensor); ``buffer = 0`` gives 0 up to L_max."""
    if buffer < 0 or buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} must lie in [0, max_len={max_len}]")
    lengths = torch.as_tensor(length, dtype=torch.float64)
    expected = max_len - buffer
    inside = (expected - lengths) / max(buffer, 1)
    r = torch.where(lengths <= max_len, inside, -torch.ones_like(lengths))
    r = torch.where(lengths <= expected, torch.zeros_like(lengths), r)
    r = r * factor
    return float(r) if not isinstance(length, torch.Tensor) else r
