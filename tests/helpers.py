"""Hand-made rollout batches for formula tests."""

from __future__ import annotations

import torch

from grpo.foundation.batch import RolloutBatch
from grpo.training.configure import load_config


def make_batch(lengths: list[int], rewards: list[float], group_size: int, width: int, seed: int = 0,
               dtype=torch.float64) -> RolloutBatch:
    """Rows with given completion lengths and rewards; old/ref log-probs random but fixed."""
    g = torch.Generator().manual_seed(seed)
    R = len(lengths)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(dtype)
    batch = RolloutBatch(
        prompt_ids=[[5, 6]] * R,
        completion_ids=[[7] * n for n in lengths],
        mask=mask,
        truncated=torch.tensor([n == width for n in lengths]),
        group_size=group_size,
        prompt_index=[i // group_size for i in range(R)],
        items=[{"prompt": "p", "answer": "a"} for _ in range(R)],
        prompt_text=["p"] * R,
        completion_text=["c"] * R,
        rewards=torch.tensor(rewards, dtype=dtype),
    )
    batch.old_logp = (-torch.rand(R, width, generator=g, dtype=dtype) * 2 - 0.1) * mask
    batch.ref_logp = (-torch.rand(R, width, generator=g, dtype=dtype) * 2 - 0.1) * mask
    batch.entropy = torch.rand(R, width, generator=g, dtype=dtype) * 3 * mask
    return batch


def policy_logp(batch: RolloutBatch, spread: float = 0.5, seed: int = 1) -> torch.Tensor:
    """Current log-probs near the old ones, so that some ratios clip and some do not (a leaf)."""
    g = torch.Generator().manual_seed(seed)
    base = batch.old_logp if batch.old_logp is not None else -torch.ones_like(batch.mask)
    noise = (torch.rand(base.shape, generator=g, dtype=base.dtype) - 0.5) * 2 * spread
    return ((base + noise) * batch.mask).clone().requires_grad_(True)


def config(algo: str = "grpo", **overrides):
    return load_config(algo=algo, overrides=[f"{k}={v}" for k, v in overrides.items()])
