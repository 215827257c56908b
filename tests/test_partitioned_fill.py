"""A ZeRO-3 partition filled straight from a .safetensors file (grpo/training/partitioned.py): every rank's
bytes, for any number of ranks, put together give the tensor (in the partition's dtype), the last partition's
padding zeroed; a size mismatch fails with a message. One process, no DeepSpeed: a partition is a flat tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from grpo.foundation.config import ConfigError
from grpo.training.partitioned import fill_partition, safetensors_index


def partition(numel: int, world: int, dtype=torch.float32, device: str = "cpu"):
    """What fill_partition uses of a ZeRO-3 parameter: its whole size and this rank's flat partition."""
    return SimpleNamespace(ds_numel=numel, ds_tensor=torch.full((-(-numel // world),), 7.0, dtype=dtype, device=device))


@pytest.fixture
def weights(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"matrix": torch.randn(7, 5, generator=g), "vector": torch.randn(3, generator=g),
               "cube": torch.randn(2, 3, 4, generator=g).bfloat16()}  # stored bf16, loaded into fp32 partitions
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # on a GPU: read via the host
@pytest.mark.parametrize("world", [1, 2, 3, 8, 40])
def test_partitions_put_together_give_the_tensor(weights, world, device):
    path, tensors = weights
    start, header = safetensors_index(path)
    with open(path, "rb", buffering=0) as f:
        for name, want in tensors.items():
            parts = []
            for rank in range(world):
                p = partition(want.numel(), world, device=device)
                fill_partition(p, f, start, header[name], rank)
                parts.append(p.ds_tensor)
            flat = torch.cat(parts).cpu()
            assert torch.equal(flat[: want.numel()], want.float().reshape(-1)), name
            assert (flat[want.numel():] == 0).all(), name  # padding beyond the tensor


def test_size_mismatch_is_an_error(weights):
    path, tensors = weights
    start, header = safetensors_index(path)
    with open(path, "rb", buffering=0) as f, pytest.raises(ConfigError, match="35 elements for a parameter of 36"):
        fill_partition(partition(36, 2), f, start, header["matrix"], 0)
