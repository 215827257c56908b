"""CUDA checks (marker ``gpu``: deselected where torch sees no GPU, see conftest.py): the one-rank trainer in
bf16 on the GPU, and the policy's log-probs on the GPU against the CPU's.

The rest of the fast suite runs on CUDA too on a GPU machine (the one-rank trainer takes the GPU there):
    python -m pytest -m "not slow and not vllm" tests
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from grpo.training.configure import load_config

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
FP32_TOLERANCE = 1e-4  # the same fp32 model on two devices: different kernels, float32 rounding only


def demo_config(tmp_path, *overrides: str):
    return load_config(ROOT / "configs" / "demo.yaml", "grpo", [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "reward_pool.num_workers=0",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", *overrides])


def test_bf16_training_steps_run_on_the_gpu(single_rank_env, tmp_path):
    from grpo.training.trainer import Trainer

    tr = Trainer(demo_config(tmp_path, "model.dtype=bf16", "algo.beta=0.04", "train.lr=1e-3"))
    assert tr.device.type == "cuda"
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in tr.model.parameters())
    assert tr.reference.kind == "in-process" and next(tr.reference.impl.model.parameters()).is_cuda
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    steps = [tr.train_step() for _ in range(3)]
    for m in steps:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, m
    assert steps[-1]["kl"] > 0  # the policy moved away from the reference
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    # each phase's peak holds at least the weights (policy, reference) and, in training, the optimizer states
    weights = sum(p.numel() * p.element_size() for p in tr.model.parameters()) / 2**30
    for m in steps:
        assert min(m["memory/generate_gib"], m["memory/logprobs_gib"]) > weights, m
        assert m["memory/train_gib"] > 2 * weights, m
    assert tr.memory.run_peak / 2**30 >= max(m["memory/train_gib"] for m in steps)
    # the first training passes ask the device for their memory; every count is a whole, non-negative number
    assert steps[0]["memory/train_device_allocs"] > 0
    assert all(m[k] >= 0 and m[k] == int(m[k]) for m in steps for k in m if k.endswith("_device_allocs"))
    tr.close()


def test_policy_logprobs_on_the_gpu_equal_the_cpu(tmp_path):
    from grpo.foundation.logprobs import pack
    from grpo.foundation.modeling import load_model, load_tokenizer
    from grpo.reference.protocol import sliced_logprobs

    cfg = demo_config(tmp_path)
    model = load_model(cfg.model)
    tok = load_tokenizer(cfg.model.name_or_path)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 7, 12)]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 3, 10, 1)]
    packed = pack(prompts, completions, tok.pad_token_id)

    def logprobs(m):
        return sliced_logprobs(m.eval(), packed, 1.0, cfg.train.logprob_chunk_size)[0]

    cpu = logprobs(model)
    gpu = logprobs(model.to("cuda"))
    assert cpu.shape == gpu.shape and gpu.device.type == "cpu"
    assert (cpu - gpu).abs().max().item() <= FP32_TOLERANCE
