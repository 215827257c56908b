"""Models built partitioned under ZeRO-3: no rank ever holds all of a model's weights.

``load_partitioned`` builds the architecture under ``deepspeed.zero.Init`` (each module's weights
are split over the ranks as soon as the module exists) and then fills this rank's share of every
weight from the safetensors files, one tensor at a time: the transient cost is the largest single
tensor, not the model. ``frozen_partitioned`` wraps such a model in an optimizer-less ZeRO-3 engine
for the in-process reference, whose forwards are then collective like the policy's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo.foundation import dist
from grpo.foundation.config import Config, ConfigError
from grpo.foundation.modeling import DTYPES, load_model, prepare_model
from grpo.foundation.tiny import BUILTIN_NAME


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"{folder}: no safetensors weights to load partitioned under ZeRO-3 (model.safetensors "
                      f"or an index); re-save the model with save_pretrained(safe_serialization=True)")


def fill_partition(param: torch.nn.Parameter, full: torch.Tensor, rank: int) -> None:
    """Copy this rank's slice of ``full`` (flattened) into the ZeRO-3 partition of ``param``."""
    flat = full.reshape(-1).to(param.ds_tensor.dtype)
    if flat.numel() != param.ds_numel:
        raise ConfigError(f"checkpoint tensor of {flat.numel()} elements for a parameter of {param.ds_numel}")
    size = param.ds_tensor.numel()
    part = flat[rank * size : (rank + 1) * size]
    with torch.no_grad():
        param.ds_tensor.zero_()
        param.ds_tensor[: part.numel()].copy_(part)


def load_partitioned(cfg: Config, source: str, ds_config: dict) -> torch.nn.Module:
    """The model of ``source`` (an HF folder) built under ZeRO-3 partitioning; the built-in tiny model is
    built whole (DeepSpeed partitions it when its engine starts)."""
    import deepspeed
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if source == BUILTIN_NAME or not Path(source).is_dir():
        return load_model(cfg.model, source)
    m = cfg.model
    dtype = DTYPES[m.dtype]
    config = AutoConfig.from_pretrained(source, trust_remote_code=m.trust_remote_code)
    kwargs = {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    # No initialisation: every weight comes from the files (and the partitions are empty tensors here).
    # The dtype comes from the DeepSpeed config (model.dtype): zero.Init's own dtype argument is ignored on
    # a CPU (DeepSpeed 0.19 takes bf16 there whatever it is given).
    with deepspeed.zero.Init(config_dict_or_path=ds_config), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=m.trust_remote_code, **kwargs)
    model.tie_weights()  # skipped with the initialisation; tied weights are stored once in the files
    params = dict(model.named_parameters())
    filled, rank = set(), dist.rank()
    for path in weight_files(Path(source)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in params:
                    fill_partition(params[key], f.get_tensor(key), rank)
                    filled.add(key)
    missing = sorted(set(params) - filled)
    if missing:
        raise ConfigError(f"{source}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    try:  # EOS ids and other defaults, as from_pretrained would read them
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass
    model.eval()
    return prepare_model(model, m)


def frozen_partitioned(cfg: Config, source: str, ds_config: dict) -> torch.nn.Module:
    """A frozen model (the in-process reference) kept partitioned over the ranks by an optimizer-less
    ZeRO-3 engine: each rank holds 1/world of its weights, and its forwards are collective."""
    import deepspeed

    model = load_partitioned(cfg, source, ds_config)
    model.requires_grad_(False)
    conf = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}
    engine, *_ = deepspeed.initialize(model=model, config=conf)
    engine.module.eval()
    engine.module._grpo_engine = engine  # the engine owns the gathering hooks: it lives as long as the module
    return engine.module
