"""A ZeRO-3 partition filled straight from a .safetensors file (grpo/training/partitioned.py): every rank's
bytes, for any number of ranks, put together give the tensor (in the partition's dtype), the last partition's
padding zeroed; a size mismatch fails with a message; a mixture of experts' fused weights are filled from their
per-expert tensors. One process, no DeepSpeed: a partition is a flat tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from grpo.foundation.config import ConfigError
from grpo.training.partitioned import fill_pieces, safetensors_index


def partition(numel: int, world: int, dtype=torch.float32, device: str = "cpu"):
    """What fill_pieces uses of a ZeRO-3 parameter: its whole size and this rank's flat partition."""
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
                fill_pieces(p, [(f, start, header[name])], rank)
                parts.append(p.ds_tensor)
            flat = torch.cat(parts).cpu()
            assert torch.equal(flat[: want.numel()], want.float().reshape(-1)), name
            assert (flat[want.numel():] == 0).all(), name  # padding beyond the tensor


def test_size_mismatch_is_an_error(weights):
    path, tensors = weights
    start, header = safetensors_index(path)
    with open(path, "rb", buffering=0) as f, pytest.raises(ConfigError, match="35 elements for a parameter of 36"):
        fill_pieces(partition(36, 2), [(f, start, header["matrix"])], 0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_expert_weights_are_filled_from_their_per_expert_tensors(tmp_path, arch):
    """transformers saves a mixture of experts per expert and fuses the experts into [E, 2 I, H] / [E, H, I] weights
    at load: each rank's partition, read from the per-expert tensors (``expert_pieces``), put together gives the
    fused weight that ``from_pretrained`` builds, for any number of ranks. Mixtral: its own checkpoint names
    (block_sparse_moe.experts.E.w1 / w3 / w2), written here as Mixtral's published checkpoints hold them."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    from grpo.foundation.tiny import write_tiny
    from grpo.training.partitioned import expert_pieces, fill_pieces

    if arch == "qwen3_moe":
        folder = write_tiny(tmp_path / "moe", arch="qwen3_moe")
    else:
        torch.manual_seed(0)
        model = MixtralForCausalLM(MixtralConfig(vocab_size=37, hidden_size=16, intermediate_size=24,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 num_local_experts=3))
        folder = tmp_path / "mixtral"
        model.save_pretrained(folder)
        names = sorted(safetensors_index(folder / "model.safetensors")[1])
        assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in names  # the published layout
    fused = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(folder).named_parameters()
             if ".experts." in n}
    assert len(fused) == 4  # gate_up_proj and down_proj of both layers
    path = folder / "model.safetensors"
    start, header = safetensors_index(path)
    with open(path, "rb", buffering=0) as f:
        stored = {k: (f, start, entry) for k, entry in header.items()}
        for name, want in fused.items():
            pieces = expert_pieces(name, tuple(want.shape), stored)
            assert pieces and name not in stored
            for world in (1, 3, 7):
                parts = []
                for rank in range(world):
                    p = partition(want.numel(), world)
                    fill_pieces(p, [stored[n] for n in pieces], rank)
                    parts.append(p.ds_tensor)
                assert torch.equal(torch.cat(parts)[: want.numel()], want.reshape(-1)), (name, world)
    assert expert_pieces("model.layers.0.mlp.down_proj.weight", (4, 4), stored) is None  # a dense MLP's weight
