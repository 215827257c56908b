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
