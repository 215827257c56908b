"""LoRA (model.lora, through PEFT), the reference for free (the policy with its adapters off), and
periodic reference sync for every algorithm (ref.sync_every, ref.mixup_alpha).

All fast tests use the tiny model on one in-process rank; the one slow test runs the DeepSpeed
launcher with 2 CPU ranks (gradient invariance with LoRA under ZeRO-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo.foundation.config import ConfigError, LoraConfig
from grpo.training.configure import load_config

ROOT = Path(__file__).resolve().parent.parent
LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}"


# --------------------------------------------------------------------------- config


def test_lora_config_off_by_default_and_on_with_defaults():
    assert load_config(None, "grpo", []).model.lora is None
    lora = load_config(None, "grpo", ["model.lora={}"]).model.lora
    assert isinstance(lora, LoraConfig) and lora.r > 0 and lora.alpha > 0 and lora.target_modules
    cfg = load_config(None, "grpo", ["model.lora.r=8", "model.lora.dropout=0.05"])  # one key turns it on
    assert (cfg.model.lora.r, cfg.model.lora.dropout) == (8, 0.05)
    assert load_config(None, "grpo", [LORA, "model.lora=null"]).model.lora is None
    ref = load_config(None, "grpo", []).ref
    assert (ref.sync_every, ref.mixup_alpha) == (0, 1.0)


@pytest.mark.parametrize("override, message", [
    ("model.lora.r=0", r"model.lora.r=0 is invalid: it must be > 0"),
    ("model.lora.alpha=0", r"model.lora.alpha=0.0 is invalid: it must be > 0"),
    ("model.lora.dropout=1", r"model.lora.dropout=1.0 is invalid: it must be in \[0, 1\)"),
    ("model.lora.dropout=-0.1", r"model.lora.dropout=-0.1 is invalid"),
    ("model.lora.target_modules=[]", r"model.lora.target_modules is empty: name the linear layers"),
    ("model.lora.target_modules=[q_proj, '']", r"model.lora.target_modules\[1\]='' is invalid"),
    ("model.lora.modules_to_save=['']", r"model.lora.modules_to_save\[0\]='' is invalid"),
    ("model.lora.target_module=[q_proj]", r"unknown config key 'model.lora.target_module'. Did you mean 'target_modules'\?"),
    ("model.lora=3", r"model.lora must be a mapping of keys \(r, alpha, dropout"),
    ("ref.sync_every=-1", r"ref.sync_every=-1 is invalid: it must be >= 0 \(0 = off\)"),
    ("ref.mixup_alpha=0", r"ref.mixup_alpha=0.0 is invalid: it must be in \(0, 1\]"),
    ("ref.mixup_alpha=1.5", r"ref.mixup_alpha=1.5 is invalid: it must be in \(0, 1\]"),
])
def test_lora_and_sync_config_errors_name_the_value_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, "grpo", [override])


def test_lora_config_refuses_what_it_does_not_support():
    with pytest.raises(ConfigError, match=r"model.lora with train.zero_stage=3 is not supported.*zero_stage 0, 1 or 2"):
        load_config(None, "grpo", [LORA, "train.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"model.lora with model.dtype='fp16' is not supported.*bf16"):
        load_config(None, "grpo", [LORA, "model.dtype=fp16"])
    with pytest.raises(ConfigError, match=r"ref.mixup_alpha=0.5 has no effect without ref.sync_every"):
        load_config(None, "grpo", ["ref.mixup_alpha=0.5"])
    with pytest.raises(ConfigError, match=r"ref.sync_every=4 needs a reference.*algo.beta=0"):
        load_config(None, "dapo", ["ref.sync_every=4"])
    load_config(None, "grpo", [LORA, "train.zero_stage=2", "model.dtype=bf16", "ref.sync_every=4", "ref.mixup_alpha=0.5"])


# --------------------------------------------------------------------------- helpers


def make_trainer(tmp_path, *overrides: str, algo: str = "grpo", resume: bool = False):
    from grpo.training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "demo.yaml", algo, [
        f"train.output_dir={tmp_path}", "logging.progress_bar=false", "logging.plot=false", "reward_pool.num_workers=0",
        "rollout.prompts_per_step=2", "rollout.num_generations=4", *overrides])
    return Trainer(cfg, resume=resume)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def is_adapter_key(key: str) -> bool:
    return ".lora_" in key


def perturb_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """Non-zero B (LoRA starts at B = 0, where the adapted model is the base): the checks below see a real adapter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)


def batch_packed(tr):
    batch = tr.generate(tr._rank_indices())
    return batch, batch.packed(None, tr.tokenizer.pad_token_id)


def plain_logprobs(model, packed, cfg) -> torch.Tensor:
    """Log-probs as the in-process reference computes them (eval mode, the same row slices)."""
    from grpo.reference.base import sliced_logprobs

    return sliced_logprobs(model.eval(), packed, cfg.rollout.temperature, cfg.train.logprob_chunk_size,
                           max_rows=cfg.train.micro_batch_size)[0]


def policy_logprobs(tr, packed) -> torch.Tensor:
    was = tr.model.training
    out = plain_logprobs(tr.model, packed, tr.cfg)
    tr.model.train(was)
    return out


# --------------------------------------------------------------------------- training: only adapters


def test_only_adapters_train_the_base_stays_bit_identical_and_the_reference_is_the_base(single_rank_env, tmp_path):
    from grpo.foundation.modeling import load_model

    tr = make_trainer(tmp_path, LORA, "algo.beta=0.04", "train.lr=1e-2")
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj", "up_proj"}
    opt = getattr(tr.engine.optimizer, "optimizer", tr.engine.optimizer)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in tr.model.parameters() if p.requires_grad}  # only the adapters reach it
    # the reference is the policy itself (adapters off): no second model anywhere
    assert tr.reference.kind == "adapters-off" and tr.reference.impl.model is tr.model is tr.engine.module
    assert tr.rollout.setup.model is tr.model  # the hf engine generates with the adapted model

    perturb_adapters(tr.model)  # B != 0: the policy differs from the reference, the KL term has a gradient
    before = snapshot(tr.model)
    for _ in range(2):
        m = tr.train_step()
    assert m["kl"] > 0
    after = snapshot(tr.model)
    base = [k for k in before if not is_adapter_key(k)]
    assert base and all(torch.equal(before[k], after[k]) for k in base)  # bit-identical
    for part in ("lora_A", "lora_B"):
        assert any(not torch.equal(before[k], after[k]) for k in before if part in k), part
    assert len(opt.state) == len(in_opt)

    # with LoRA the reference log-probs are the base model's, exactly
    tr.model.train()
    _, packed = batch_packed(tr)
    ref = tr.reference.logprobs(packed, tr.cfg.rollout.temperature)
    assert tr.model.training  # its mode is restored
    fresh_base = load_model(tr.cfg.model)
    assert torch.equal(ref, plain_logprobs(fresh_base, packed, tr.cfg))
    policy = policy_logprobs(tr, packed)
    assert (policy - ref).abs().max() > 1e-3  # and the adapters are back on afterwards
    tr.close()


def test_bf16_base_with_fp32_adapters(single_rank_env, tmp_path):
    from grpo.training.deepspeed_engine import deepspeed_config

    tr = make_trainer(tmp_path, LORA, "model.dtype=bf16", "algo.beta=0.04", "train.lr=1e-2")
    dtypes = {n: p.dtype for n, p in tr.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if is_adapter_key(n))
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if not is_adapter_key(n))
    assert "bf16" not in deepspeed_config(tr.cfg)  # the adapters train in DeepSpeed's fp32 mode
    perturb_adapters(tr.model)
    before = snapshot(tr.model)
    for _ in range(2):
        tr.train_step()
    after = snapshot(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before if not is_adapter_key(k))
    assert any(not torch.equal(before[k], after[k]) for k in before if "lora_A" in k)
    tr.close()


def test_reference_kind_with_lora(single_rank_env, monkeypatch):
    import grpo.reference.http as http
    from grpo.reference.handle import make_reference
    from grpo.foundation.modeling import load_policy

    class FakeServer:
        def __init__(self, cfg, tokenizer=None, vocab_size=None):
            self.url = cfg.ref.url

    monkeypatch.setattr(http, "HTTPReference", FakeServer)
    cfg = load_config(None, "grpo", [LORA])
    policy = load_policy(cfg.model)
    assert make_reference(cfg, True, torch.device("cpu"), policy=policy).kind == "adapters-off"
    assert make_reference(cfg, False, torch.device("cpu"), policy=policy) is None  # beta = 0: nothing
    served = load_config(None, "grpo", [LORA, "ref.url=http://127.0.0.1:1"])
    assert make_reference(served, True, torch.device("cpu"), policy=policy).kind == "server"  # ref.url still works
    other = load_config(None, "grpo", [LORA, "ref.model=builtin:tiny-char"])
    assert make_reference(other, True, torch.device("cpu"), policy=policy).kind == "in-process"
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['nope'\] match no linear layer"):
        load_policy(load_config(None, "grpo", ["model.lora.target_modules=[nope]"]).model)
    with pytest.raises(ConfigError, match=r"names \['lm_head'\], whose weight this model ties"):
        load_policy(load_config(None, "grpo", ["model.lora.target_modules=[q_proj, lm_head]"]).model)
