"""LoRA adapters through PEFT, injected in place into the transformers model.

The trainer keeps training the transformers model itself (``LlamaForCausalLM`` and the like), now
with PEFT's LoRA layers inside it: ``peft.get_peft_model`` replaces each target linear layer with a
``lora.Linear`` that holds the frozen ``base_layer`` and the trainable ``lora_A`` / ``lora_B``, and
freezes everything else. The ``PeftModel`` wrapper is not kept: the log-prob path, generation and
DeepSpeed all see the same module as without LoRA, and everything LoRA needs is here:

    apply_lora(model, cfg, base)    inject the adapters (only they train; fp32 even on a bf16 base)
    adapters_disabled(model)        a context in which the model is its frozen base (the free reference)
    add_adapter(model, folder, name) another saved adapter beside the model's own, frozen (a teacher)
    adapter_active(model, name)     a context in which the model is its base with that adapter
    save_adapter(model, folder)     PEFT's own format: ``PeftModel.from_pretrained(base, folder)`` loads it
    base_state_dict(model)          the frozen base's weights, under the transformers model's own names
    merged_state_dict(model)        the adapted policy's weights (base + scale * B A), same names
    sync_base(model, alpha)         pi_ref <- alpha pi_theta + (1 - alpha) pi_ref for the free reference,
                                    policy unchanged (see the function)
    load_base(model, state_dict)    put base weights back (a resumed run after such a sync)
    load_adapter_folder(folder)     base + adapter of a saved adapter folder, merged into a plain model
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from grpo.foundation.config import ConfigError, LoraConfig
from grpo.foundation.weights import mix_

ADAPTER = "default"  # PEFT's name of the one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


def is_adapter_folder(path: str | Path) -> bool:
    """A folder written by ``save_adapter`` / ``PeftModel.save_pretrained`` (adapter, not a whole model)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def has_lora(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict) and ADAPTER in model.peft_config


def _tied_embeddings(model) -> tuple[set[str], set[str]]:
    """(input, output) embedding module names when the model ties their weights (tie_word_embeddings), else empty."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return set(), set()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    names = dict(model.named_modules())
    return ({n for n, m in names.items() if m is inp}, {n for n, m in names.items() if out is not None and m is out})


def _names(cfg_names: list[str], modules: set[str]) -> list[str]:
    return sorted({n for n in modules for t in cfg_names if n == t or n.endswith("." + t)})


def apply_lora(model, cfg: LoraConfig, base_name: str, freeze_bottom_layers: int = 0):
    """Inject LoRA adapters into ``model`` in place and return it (the same transformers model).

    Only adapter parameters (and ``modules_to_save``) keep ``requires_grad``. Adapters are float32 whatever
    the base's dtype (PEFT's ``autocast_adapter_dtype``). With ``freeze_bottom_layers = n`` only the
    layers above n get adapters (the backward pass stops there, as without LoRA). ``base_name`` is written
    into the adapter's config (``base_model_name_or_path``), so a saved adapter names its base.

    Tied embeddings (``tie_word_embeddings``): adapters on either embedding are refused (one update would
    change both ends); ``modules_to_save: [lm_head]`` trains a copy of the output head while the input
    embeddings stay the frozen original, so the adapted model is untied from then on (merged and exported
    models are saved with ``tie_word_embeddings: false``).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    tied_in, tied_out = _tied_embeddings(model)
    clash = _names(cfg.target_modules, tied_in | tied_out)
    if clash:
        raise ConfigError(f"model.lora.target_modules={cfg.target_modules} names {clash}, whose weight this model ties "
                          "to the other embedding (tie_word_embeddings): leave it out; to train the output head, "
                          "name it in model.lora.modules_to_save")
    clash = _names(cfg.modules_to_save, tied_in)
    if clash:
        raise ConfigError(f"model.lora.modules_to_save={cfg.modules_to_save} names the input embeddings {clash}, which "
                          "this model ties to its output head: name the head (e.g. lm_head) instead")
    if cfg.modules_to_save and next(model.parameters()).dtype != torch.float32:
        raise ConfigError(f"model.lora.modules_to_save={cfg.modules_to_save} with a {next(model.parameters()).dtype} "
                          "base is not supported: those modules would train in that dtype; use model.dtype=fp32")
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in cfg.target_modules if t not in names and not any(n.endswith(t) for n in names)]
    if missing:
        raise ConfigError(f"model.lora.target_modules: {missing} match no linear layer of "
                          f"{type(model).__name__}; its linear layers are {sorted(names)}")
    layers = None
    if freeze_bottom_layers:
        count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
        if count is None:
            raise ConfigError("model.freeze_bottom_layers with model.lora: cannot tell the model's number of layers")
        layers = list(range(freeze_bottom_layers, count))
        if not layers:
            raise ConfigError(f"model.freeze_bottom_layers={freeze_bottom_layers} leaves no layer for model.lora")
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), modules_to_save=list(cfg.modules_to_save) or None,
                              layers_to_transform=layers, bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # PEFT warns that a tied head is part of the adapter: handled here (the head trains untied, see above)
        warnings.filterwarnings("ignore", message=r".*tie_word_embeddings=True. and a tied layer is part of the adapter")
        # PEFT reads transformers' deprecated is_gradient_checkpointing (a FutureWarning on every run)
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing. is deprecated", category=FutureWarning)
        wrapped = get_peft_model(model, peft_cfg, autocast_adapter_dtype=True)
    inner = wrapped.get_base_model()
    inner.peft_config[ADAPTER].base_model_name_or_path = base_name
    if _names(cfg.modules_to_save, tied_out):
        set_untied(inner)  # the head trains apart from the embeddings (its original is still shared: see sync_base)
    return inner


def state_dict_for_save(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` ready for ``save_pretrained``: when the config says the embeddings are not tied, tensors
    that still share storage (a frozen original head and the embeddings) are saved as separate copies."""
    config = getattr(model, "config", None)
    if config is None or getattr(config.get_text_config(), "tie_word_embeddings", False):
        return state_dict
    seen, out = set(), {}
    for k, v in state_dict.items():
        out[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    return out


def set_base_name(model, base_name: str) -> None:
    """The base an adapter saved from now on names (after a reference sync merged into the base)."""
    model.peft_config[ADAPTER].base_model_name_or_path = base_name


def _adapter_modules(model):
    """What PeftModel.disable_adapter switches: adapter layers and wrapped (modules_to_save) modules."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper as Wrapper  # peft >= 0.15
    except ImportError:  # pragma: no cover
        from peft.utils import ModulesToSaveWrapper as Wrapper
    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, Wrapper))]


@contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """Within the context the model computes its frozen base (PeftModel.disable_adapter, on the bare model)."""
    modules = _adapter_modules(model)
    was = [not getattr(m, "disable_adapters", False) for m in modules]
    try:
        for m in modules:
            m.enable_adapters(False)
        yield
    finally:
        for m, on in zip(modules, was):
            m.enable_adapters(on)


@contextmanager
def adapter_active(model, name: str) -> Iterator[None]:
    """Within the context the model computes its frozen base with adapter ``name`` (``add_adapter``) instead of
    its own; afterwards its own adapter is active again and every parameter's ``requires_grad`` is as it was
    (PEFT's ``set_adapter`` marks the active adapter trainable)."""
    modules = _adapter_modules(model)
    grads = [(p, p.requires_grad) for p in model.parameters()]
    was = [list(m.active_adapters) for m in modules]
    try:
        for m in modules:
            m.set_adapter(name)
        yield
    finally:
        for m, names in zip(modules, was):
            m.set_adapter(names)
        for p, g in grads:
            p.requires_grad_(g)


def same_base(saved: str, now: str) -> bool:
    """An adapter's base (``base_model_name_or_path``) names the model's base: the same name or folder, or a
    reference folder a sync wrote (``.../reference/step-N``: a run's base after a sync, which cannot be told)."""
    if saved == now:
        return True
    a, b = Path(saved), Path(now)
    if a.exists() and b.exists() and a.resolve() == b.resolve():
        return True
    return a.is_absolute() and a.parent.name == "reference"


def add_adapter(model, folder: str | Path, name: str) -> None:
    """Load a saved LoRA adapter (PEFT's format) next to the model's own, under ``name``, inactive and frozen: the
    base's weights are shared, the adapter adds its A and B. Every key of the folder's weights must land on a new
    parameter and every new parameter must be loaded (a ConfigError names the first that does not)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model
    from safetensors.torch import load_file

    folder = Path(folder)
    if not is_adapter_folder(folder) or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{folder} is not a LoRA adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, as a LoRA "
                          f"run's checkpoints hold them)")
    peft_cfg = PeftLoraConfig.from_pretrained(str(folder))
    if peft_cfg.modules_to_save:
        raise ConfigError(f"{folder}: the adapter trains whole modules too (modules_to_save={peft_cfg.modules_to_save}),"
                          f" which cannot be shared with the policy's base; use an adapter without them")
    theirs = str(peft_cfg.base_model_name_or_path or "")
    mine = str(getattr(model.peft_config.get(ADAPTER), "base_model_name_or_path", "") or "")
    if theirs and mine and not same_base(theirs, mine):
        raise ConfigError(f"{folder}: the adapter was trained on {theirs!r}, and this model's base is {mine!r} "
                          f"(model.name_or_path): an adapter's weights are changes to its own base's, so on another "
                          f"base it is another model. Use an adapter trained on {mine!r}, or a whole teacher "
                          f"(teacher.model)")
    own = dict(model.peft_config)
    grads = [(p, p.requires_grad) for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing. is deprecated", category=FutureWarning)
        inject_adapter_in_model(peft_cfg, model, adapter_name=name)
    model.peft_config = {**own, name: peft_cfg}
    for m in _adapter_modules(model):  # the model's own adapter stays the active one
        m.set_adapter(ADAPTER)
    for p, g in grads:
        p.requires_grad_(g)
    params = {n: p for n, p in model.named_parameters() if f".{name}." in f".{n}." and "lora_" in n}
    loaded = set()
    with torch.no_grad():
        for key, value in load_file(str(folder / ADAPTER_WEIGHTS)).items():
            parts = key[len(PEFT_PREFIX):].split(".") if key.startswith(PEFT_PREFIX) else key.split(".")
            at = next((i for i, x in enumerate(parts) if x.startswith("lora_")), None)
            target = None if at is None else ".".join(parts[: at + 1] + [name] + parts[at + 1:])
            if target not in params or params[target].shape != value.shape:
                raise ConfigError(f"{folder}: its weight {key} {list(value.shape)} has no place in this model "
                                  f"(is the adapter trained on model.name_or_path's base?)")
            params[target].copy_(value.to(params[target].dtype))
            params[target].requires_grad_(False)
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ConfigError(f"{folder}: {len(missing)} of the adapter's parameters are not in its weights, e.g. "
                          f"{missing[0]}")


# --------------------------------------------------------------------------- weights


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


def _saved_modules(model):
    from peft.utils import ModulesToSaveWrapper

    return [(n, m) for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)]


def _plain_name(key: str) -> Optional[str]:
    """The transformers name of a base weight in the injected model's state dict (None: an adapter's own)."""
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts:
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def base_state_dict(model) -> dict[str, torch.Tensor]:
    """The frozen base model's weights (what the model computes with its adapters off), transformers' names."""
    out = {}
    for key, value in model.state_dict().items():
        name = _plain_name(key)
        if name is not None:
            out[name] = value
    return out


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapted policy's weights, transformers' names: W + scale * B A for every adapted layer (computed
    in float32, stored in the base's dtype), the trained copy of every ``modules_to_save`` module."""
    out = base_state_dict(model)
    for name, layer in _lora_layers(model):
        key = f"{name}.weight"
        w = layer.get_base_layer().weight
        out[key] = (w.float() + layer.get_delta_weight(ADAPTER).float()).to(w.dtype)
    for name, wrapper in _saved_modules(model):
        for k, v in wrapper.modules_to_save[ADAPTER].state_dict().items():
            out[f"{name}.{k}"] = v
    return out


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """PEFT's adapter state dict as ``PeftModel.save_pretrained`` writes it: keys without the adapter's name,
    relative to the PeftModel wrapper (``base_model.model.`` + the transformers model's own names)."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    return {PEFT_PREFIX + k: v for k, v in sd.items()}


def save_adapter(model, folder: str | Path) -> Path:
    """Write the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), as
    ``PeftModel.save_pretrained`` does; ``PeftModel.from_pretrained(base, folder)`` loads it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config[ADAPTER].save_pretrained(str(folder))
    weights = {k: v.detach().cpu().contiguous() for k, v in adapter_state_dict(model).items()}
    save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return folder


def adapter_base_name(folder: str | Path) -> str:
    cfg = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{folder}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return str(base)


def untie_saved_modules(model) -> None:
    """Give the frozen original of every ``modules_to_save`` module weights of its own where they are tied to
    another module's (lm_head <-> embed_tokens): the original can then change (a reference sync) without
    moving the policy's input embeddings. The model is untied from then on (its config says so)."""
    prefixes = tuple(f"{n}." for n, _ in _saved_modules(model))
    others = {p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith(prefixes)}
    changed = False
    for _, wrapper in _saved_modules(model):
        for name, mod in list(wrapper.original_module.named_modules()):
            for pname, p in list(mod.named_parameters(recurse=False)):
                if p.data_ptr() in others:
                    setattr(mod, pname, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
                    changed = True
    if changed:
        set_untied(model)


def set_untied(model) -> None:
    """The model's config says its embeddings are not tied (an output head trained apart from them)."""
    for c in {id(model.config): model.config, id(model.config.get_text_config()): model.config.get_text_config()}.values():
        c.tie_word_embeddings = False


@torch.no_grad()
def sync_base(model, alpha: float = 1.0) -> None:
    """pi_ref <- alpha pi_theta + (1 - alpha) pi_ref for the free reference (the base), keeping the policy.

    With the policy W + D (D = scale B A) and the reference W, the mixed reference is
    alpha (W + D) + (1 - alpha) W = W + alpha D: each base weight takes alpha D, and B is scaled by
    (1 - alpha), so the adapter adds the remaining (1 - alpha) D and the policy stays W + D (up to the
    rounding of the base's dtype). alpha = 1 merges the adapter into the base and zeroes B: the
    reference becomes the policy, and the adapter starts again from B = 0 with A as it is (as
    LoRA starts). A ``modules_to_save`` module's frozen original is mixed with its trained copy (an output
    head tied to the input embeddings is untied first: the embeddings, the same in policy and reference,
    stay as they are). Every rank calls it (the same arithmetic on the same weights everywhere).
    """
    untie_saved_modules(model)
    for _, layer in _lora_layers(model):
        w = layer.get_base_layer().weight
        w.copy_((w.float() + alpha * layer.get_delta_weight(ADAPTER).float()).to(w.dtype))
        b = layer.lora_B[ADAPTER].weight
        if alpha == 1.0:
            b.zero_()
        else:
            b.mul_(1.0 - alpha)
    for _, wrapper in _saved_modules(model):
        trained = dict(wrapper.modules_to_save[ADAPTER].named_parameters())
        for k, p in wrapper.original_module.named_parameters():
            mix_(p, trained[k], alpha)


@torch.no_grad()
def load_base(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy base weights (transformers' names, as ``base_state_dict`` gives) into the frozen base."""
    untie_saved_modules(model)  # a synced base's head may differ from its embeddings
    targets = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = _plain_name(key)
        if name is not None:
            targets[name] = value
    missing = [k for k in targets if k not in state_dict and not _tied_alias(model, k)]
    if missing:
        raise RuntimeError(f"base weights missing {missing[:5]} (of {len(missing)})")
    for k, t in targets.items():
        if k in state_dict:
            t.copy_(state_dict[k].to(t.dtype))


def _tied_alias(model, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None)
    return isinstance(tied, dict) and key in tied


def load_adapter_folder(folder: str | Path, load_base_model) -> torch.nn.Module:
    """The model a saved adapter folder describes, merged: ``load_base_model(base_name)`` loads its base, PEFT
    applies the adapter, ``merge_and_unload`` folds it in (a plain transformers model, no PEFT inside)."""
    from peft import PeftModel

    base = load_base_model(adapter_base_name(folder))
    model = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    mark_untied_if_needed(model)
    return model


def mark_untied_if_needed(model) -> None:
    """After ``merge_and_unload``: a trained output head (modules_to_save) is its own module now; if the config
    still says the embeddings are tied, saving and loading would tie them back. Say they are not."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and out is not None and out.weight.data_ptr() != inp.weight.data_ptr():
        set_untied(model)
