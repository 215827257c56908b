"""Loading the policy / reference model and tokenizer (local folder, hub name or the builtin tiny model)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpo.foundation.config import ConfigError, ModelConfig, auto_dtype
from grpo.foundation.families import text_config

try:  # transformers 5.24 renamed the forward's KV-cache argument and output (the old name warns on every call)
    from transformers.modeling_outputs import BaseModelOutputWithPast as _Out

    CACHE_ARG = "cache" if "cache" in _Out.__dataclass_fields__ else "past_key_values"
except ImportError:  # pragma: no cover
    CACHE_ARG = "past_key_values"


def cache_of(out) -> object:
    """The KV cache a forward with ``use_cache=True`` returned (``out.cache`` or, before 5.24,
    ``out.past_key_values``)."""
    return getattr(out, CACHE_ARG)

from grpo.foundation.tiny import BUILTIN_NAME, build_builtin, is_builtin

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# layer types (transformers' ``layer_types``) that carry a recurrent state instead of, or beside, keys and values
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2")


def has_recurrent_layers(model: torch.nn.Module) -> bool:
    """Whether the decoder has layers with a recurrent state (Qwen3.5's and Qwen3-Next's Gated DeltaNet, LFM2's
    convolutions, Mamba hybrids): their cache must be built from the config (a bare DynamicCache has no place for
    the state), and the state after a right-padded prompt has also run over the padding (it decays there), so a
    prompt's state is not the one its completions continue from."""
    cfg = text_config(model)
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ()
    return any(t in RECURRENT_LAYER_TYPES for t in types)


def new_cache(model: torch.nn.Module):
    """An empty cache for ``model``'s forward: built from its config where it has recurrent layers (each layer's kind
    of state), else a bare DynamicCache (every layer's keys and values kept whole)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config) if has_recurrent_layers(model) else DynamicCache()


# first path parts that mean a folder of this checkout even when missing (the configs' models/ folder, run outputs)
LOCAL_ROOTS = ("models", "runs", "checkpoints")


def looks_local(name: str) -> bool:
    """Whether ``name`` means a folder on this machine, not a hub id (``org/name``): it starts with / . or ~,
    has more than one path separator, or its first part is an existing folder or one of LOCAL_ROOTS."""
    if name.startswith(("/", ".", "~")) or (os.sep != "/" and os.sep in name):
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and (parts[0] in LOCAL_ROOTS or Path(parts[0]).is_dir()))


LATEST = "latest"  # OUT/checkpoints/latest: a relative symlink to the newest step folder (a text file naming it before)
ASIDE = ".old-"  # prefix of a step folder renamed aside while the same step is saved again


def latest_in(root: str | Path) -> Optional[Path]:
    """The step folder ``root/latest`` names (``root``: a run's ``checkpoints`` folder), or None. Reads both
    forms: the symlink, and the text file older runs wrote. While the same step is being saved again its
    folder is briefly renamed aside; then the aside copy is the answer."""
    root = Path(root)
    marker = root / LATEST
    if marker.is_symlink():
        name = Path(os.readlink(marker)).name
    elif marker.is_file():
        name = marker.read_text().strip()
    elif marker.is_dir():  # a run folder copied with copytree, cp -L or a bucket sync: the link became a copy
        return _copied_latest(root, marker)
    else:
        return None
    for path in (root / name, root / (ASIDE + name)):
        if path.is_dir():
            return path
    return None


def _copied_latest(root: Path, copy: Path) -> Path:
    """The step folder that ``copy`` (a ``latest`` link turned into a folder) is a copy of: the one with the same
    trainer state (it holds the step and the RNG states), else the newest step; the copy itself when none is
    left."""
    steps = sorted((p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    state = copy / "trainer" / "rank0.pt"
    if state.is_file():
        same = [p for p in steps if (p / state.relative_to(copy)).is_file()
                and (p / state.relative_to(copy)).read_bytes() == state.read_bytes()]
        if same:
            return same[-1]
    return steps[-1] if steps else copy


def resolve_model_path(name: str) -> str:
    """A checkpoint given by its run: ``OUT/checkpoints/latest``, ``OUT/checkpoints`` or ``OUT`` itself become
    the newest step folder (an HF folder, or with LoRA an adapter folder); any other name is returned as is."""
    if is_builtin(name) or not looks_local(name):
        return name
    path = Path(name).expanduser()
    # a model folder is itself (a step folder holds DeepSpeed's own ``latest`` beside the weights)
    model_folder = path.is_dir() and any((path / f).is_file() for f in ("config.json", "adapter_config.json"))
    if path.name == LATEST and (path.is_symlink() or path.is_file() or path.is_dir()):
        root = path.parent
    elif path.is_dir() and not model_folder and os.path.lexists(path / LATEST):
        root = path
    elif path.is_dir() and not model_folder and os.path.lexists(path / "checkpoints" / LATEST):
        root = path / "checkpoints"
    else:
        return name
    found = latest_in(root)
    if found is None:
        raise ConfigError(f"{name!r}: {str(root / LATEST)!r} names a step folder that does not exist in {str(root)!r}")
    return str(found)


def check_model_path(key: str, name: str) -> None:
    """A model that looks local (:func:`looks_local`) and is missing fails at once, naming the path, instead of
    falling through to the hub (a minute of retries, then "couldn't connect to huggingface.co")."""
    if is_builtin(name) or not looks_local(name):
        return
    path = Path(resolve_model_path(name)).expanduser()
    if path.is_dir():
        return
    what = "is a file, not a model folder" if path.exists() else "does not exist"
    hint = ""
    if "smollm2" in name.lower():
        hint = " The SmolLM2 presets' folder is built by `python scripts/fetch_smollm2.py` (docs/troubleshooting.md)."
    raise ConfigError(
        f"{key}={name!r} looks like a local folder, and {str(path.absolute())!r} {what}. Give an existing HF model "
        f"folder (config.json and weights), a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or {BUILTIN_NAME!r}.{hint}")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token guaranteed (EOS is reused when the tokenizer has none)."""
    name_or_path = resolve_model_path(name_or_path)
    if is_builtin(name_or_path):
        return build_builtin(name_or_path)[1]
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        check_model_path("model.name_or_path", name_or_path)  # a missing local folder: said as such, not the hub's words
        raise ConfigError(
            f"model.name_or_path={name_or_path!r}: cannot load a tokenizer ({e}). "
            f"Give a local HF folder, a hub name (online), or {BUILTIN_NAME!r}."
        ) from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(f"tokenizer of {name_or_path!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_policy(cfg: ModelConfig) -> PreTrainedModel:
    """The model to train: ``load_model``, with LoRA adapters injected when ``model.lora`` is set
    (grpo/foundation/lora.py; only the adapters train)."""
    model = load_model(cfg, apply_freeze=cfg.lora is None)
    if cfg.lora is not None:
        from grpo.foundation.lora import apply_lora

        model = apply_lora(model, cfg.lora, cfg.name_or_path, cfg.freeze_bottom_layers)
    return model


def load_model(cfg: ModelConfig, name_or_path: str | None = None, safetensors_only: bool = False,
               apply_freeze: bool = True) -> PreTrainedModel:
    """A causal LM in the configured dtype (``name_or_path`` overrides cfg's, e.g. for the reference).

    ``safetensors_only``: load ``model.safetensors`` (or its index) and nothing else, never a
    pickle such as ``pytorch_model.bin`` (the reference server's reloads).
    A saved LoRA adapter folder (``adapter_config.json``, e.g. a LoRA run's checkpoint) loads as its base
    with the adapter merged in: a plain model, the adapted policy's weights.
    """
    name = resolve_model_path(name_or_path or cfg.name_or_path)
    dtype = DTYPES[auto_dtype() if cfg.dtype == "auto" else cfg.dtype]  # auto: a ModelConfig not from load_config
    from grpo.foundation.lora import is_adapter_folder

    if is_adapter_folder(name):
        from grpo.foundation.lora import load_adapter_folder

        model = load_adapter_folder(name, lambda base: load_model(cfg, base, safetensors_only, apply_freeze=False))
    elif is_builtin(name):
        model = build_builtin(name)[0].to(dtype)
    else:
        kwargs = dict(dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        if safetensors_only:
            kwargs["use_safetensors"] = True
        if cfg.attn_implementation:
            kwargs["attn_implementation"] = cfg.attn_implementation
        model = _from_pretrained(name, kwargs)
    return prepare_model(model, cfg, apply_freeze)


def _from_pretrained(name: str, kwargs: dict) -> PreTrainedModel:
    """A causal LM, or an image-text-to-text checkpoint (Mistral Small 3.1 / 3.2 and Magistral, Qwen2.5-VL, Qwen3-VL,
    LLaVA, ...) as its own class, as TRL's GRPOTrainer loads one: with text-only prompts its forward is its language
    model's (the vision tower is never reached), so it trains like any decoder."""
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise _load_error(name, e) from e
        causal = e
    except OSError as e:
        raise _load_error(name, e) from e
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(name, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise _load_error(name, e) from e
        found = re.search(r"configuration class <class '([\w.]+)'>", str(causal))
        kind = found.group(1).rsplit(".", 1)[-1] if found else "its class"
        raise ConfigError(f"model.name_or_path={name!r}: its config ({kind}) is neither a causal language model nor an "
                          f"image-text-to-text model of transformers (AutoModelForCausalLM, "
                          f"AutoModelForImageTextToText): the policy must generate text") from e
    except OSError as e:
        raise _load_error(name, e) from e


def model_class(config, name: str) -> type:
    """The Auto class that builds ``config``'s model, as :func:`_from_pretrained` picks it: AutoModelForCausalLM, or
    AutoModelForImageTextToText for a multimodal checkpoint (a partitioned build makes it from the config alone)."""
    from transformers import AutoModelForImageTextToText

    autos = (AutoModelForCausalLM, AutoModelForImageTextToText)
    remote = getattr(config, "auto_map", None) or {}
    for auto in autos:
        if type(config) in auto._model_mapping or auto.__name__ in remote:
            return auto
    raise ConfigError(f"model.name_or_path={name!r}: its config ({type(config).__name__}) is neither a causal language "
                      f"model nor an image-text-to-text model of transformers (AutoModelForCausalLM, "
                      f"AutoModelForImageTextToText): the policy must generate text")


def _load_error(name: str, e: Exception) -> ConfigError:
    return ConfigError(f"model.name_or_path={name!r}: cannot load the model ({e}). "
                       f"Give a local HF folder, a hub name (online), or {BUILTIN_NAME!r}.")


def prepare_model(model: PreTrainedModel, cfg: ModelConfig, apply_freeze: bool = True) -> PreTrainedModel:
    """What the config asks of a loaded model: its attention soft-cap kept (keep_attention_softcap), a multimodal
    checkpoint's vision side frozen (freeze_unreached), frozen bottom layers (unless ``apply_freeze`` is off),
    gradient checkpointing."""
    keep_attention_softcap(model, cfg.attn_implementation)
    check_transformers_fixes(model)
    freeze_unreached(model)
    if cfg.freeze_bottom_layers and apply_freeze:
        freeze_bottom_layers(model, cfg.freeze_bottom_layers)
    if cfg.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 (the old name warns)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def keep_attention_softcap(model: PreTrainedModel, requested: Optional[str]) -> None:
    """Gemma 2 soft-caps its attention scores (``attn_logit_softcapping``), which SDPA cannot do. transformers 5.17
    still makes SDPA Gemma 2's default and its SDPA path drops the cap without a word (later versions refuse SDPA for
    it): the trainer's, the reference's and the hf engine's forward would then not be the model's, nor the static
    engine's, which caps (0.06 nats mean between the two on an H100, docs/results.md). Such a model is switched to
    eager attention; asking for ``model.attn_implementation=sdpa`` on it is an error."""
    cap = getattr(text_config(model), "attn_logit_softcapping", None)
    impl = str(getattr(model.config, "_attn_implementation", None) or "")
    if not cap or "sdpa" not in impl:
        return
    if requested and "sdpa" in requested:
        raise ConfigError(f"model.attn_implementation={requested!r}: SDPA cannot soft-cap attention scores and this "
                          f"model caps them (attn_logit_softcapping={cap}); use eager, flex_attention or "
                          "flash_attention_2, or leave it unset (eager)")
    model.set_attn_implementation("eager")


# model types whose forward in older transformers fails on some inputs training produces: (the first version with the
# fix, when it applies to a config, what goes wrong)
TRANSFORMERS_FIXES = {
    "gemma3n_text": ("5.21", lambda c: c.vocab_size > c.vocab_size_per_layer_input,
                     "its forward looks every token id up in the per-layer embedding, which holds only the first "
                     "vocab_size_per_layer_input ids: a sampled id past them (Gemma 3n's audio and image tokens) is an "
                     "index error on CPU and a device-side assert on CUDA, in the middle of a run"),
}


def check_transformers_fixes(model: PreTrainedModel) -> None:
    """Stops at start, with the fix, where the installed transformers has a defect the run would meet later
    (TRANSFORMERS_FIXES)."""
    import transformers
    from packaging.version import Version

    text = text_config(model)
    fix = TRANSFORMERS_FIXES.get(getattr(text, "model_type", None))
    if fix is None or Version(transformers.__version__) >= Version(fix[0]) or not fix[1](text):
        return
    raise ConfigError(f"{text.model_type} with transformers {transformers.__version__}: {fix[2]}; install "
                      f"transformers>={fix[0]} (pip install -U transformers)")


def freeze_unreached(model: PreTrainedModel) -> list[str]:
    """An image-text-to-text checkpoint trains on text prompts: the parameters its text-only forward never reaches
    (the vision tower, the projector: everything outside the language model, the input embeddings and the head) are
    frozen, so they hold no optimizer state and no update touches them (under ZeRO 1-3 DeepSpeed's flat Adam
    partitions gave them zero gradients, and weight decay shrank them every step). Returns their names."""
    base = getattr(model, model.base_model_prefix, None)
    language = getattr(base, "language_model", None)
    if language is None:
        return []
    reached = {id(p) for m in (language, model.get_input_embeddings(), model.get_output_embeddings())
               if m is not None for p in m.parameters()}
    frozen = []
    for n, p in model.named_parameters():
        if id(p) not in reached and p.requires_grad:
            p.requires_grad_(False)
            frozen.append(n)
    return frozen


def freeze_bottom_layers(model: PreTrainedModel, n: int) -> None:
    """Freeze the input embeddings (and a head tied to them) and the first ``n`` decoder layers.

    The backward pass then stops at layer ``n``: on a CPU budget, most of a step's compute is
    saved while the top of the network still learns.
    """
    base = getattr(model, model.base_model_prefix, None)
    # an image-text-to-text checkpoint's decoder layers are its language model's
    layers = getattr(base, "layers", None) or getattr(getattr(base, "language_model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"model.freeze_bottom_layers: cannot find the decoder layers of {type(model).__name__}")
    if n > len(layers):
        raise ConfigError(f"model.freeze_bottom_layers={n} is more than the model's {len(layers)} layers")
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:n]:
        layer.requires_grad_(False)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id that ends a completion (tokenizer EOS plus the generation config's)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(i) for i in extra)
    if not ids:
        raise ConfigError("the tokenizer and model define no EOS token; completions could never end")
    return sorted(ids)


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters one token covers: its longest vocabulary entry (byte-level and
    SentencePiece entries are at least as long as the text they stand for). A text longer than ``n`` times
    this holds more than ``n`` tokens, so it can be refused without tokenizing it (kept on the tokenizer)."""
    cached = getattr(tokenizer, "_grpo_max_token_chars", None)
    if cached is None:
        cached = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        try:
            tokenizer._grpo_max_token_chars = cached
        except AttributeError:  # a tokenizer that takes no new attributes: computed again next time
            pass
    return cached


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hash of the vocabulary and special tokens (policy and reference must agree)."""
    vocab = tokenizer.get_vocab()
    payload = json.dumps(
        {"vocab": sorted(vocab.items()), "special": sorted(map(str, tokenizer.all_special_tokens))},
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
