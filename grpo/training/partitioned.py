"""Models built partitioned under ZeRO-3: no rank ever holds all of a model's weights.

``load_partitioned`` builds the architecture under ``deepspeed.zero.Init`` (each module's weights
are split over the ranks as soon as the module exists) and then fills this rank's share of every
weight from the safetensors files, reading only its own bytes of each tensor.
``frozen_partitioned`` wraps such a model in an optimizer-less ZeRO-3 engine for the in-process
reference, whose forwards are then collective like the policy's.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from grpo.foundation import dist
from grpo.foundation.config import Config, ConfigError
from grpo.foundation.modeling import DTYPES, load_model, model_class, prepare_model
from grpo.foundation.tiny import BUILTIN_NAME


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"{folder}: no safetensors weights to load partitioned under ZeRO-3 (model.safetensors "
                      f"or an index); re-save the model with save_pretrained(safe_serialization=True), or set "
                      f"train.zero3_init=false (each rank then loads the whole model first)")


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def safetensors_index(path: Path) -> tuple[int, dict]:
    """Where a .safetensors file's data starts, and its header: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def fill_pieces(param: torch.nn.Parameter, pieces: list[tuple], rank: int) -> None:
    """Copy this rank's slice of a parameter, flattened, into its ZeRO-3 partition, from the checkpoint tensors
    whose flattened concatenation, in order, is the parameter flattened (``pieces``: (the .safetensors file, open;
    its data start; the tensor's header entry) each: one for most weights, several for ``expert_pieces``). Only this
    rank's bytes are read (plain reads, no memory map), so a rank holds neither a whole weight nor mapped pages of
    the file."""
    numel = sum(math.prod(entry["shape"]) for _, _, entry in pieces)
    if numel != param.ds_numel:
        raise ConfigError(f"checkpoint tensor of {numel} elements for a parameter of {param.ds_numel}")
    size = param.ds_tensor.numel()
    lo, hi = min(rank * size, numel), min((rank + 1) * size, numel)
    with torch.no_grad():
        param.ds_tensor.zero_()  # the padding of the last rank's partition
        offset = 0
        for f, data_start, entry in pieces:
            n = math.prod(entry["shape"])
            a, b = max(lo, offset), min(hi, offset + n)  # this rank's elements of this piece
            if a < b:
                _read_into(param.ds_tensor[a - lo: b - lo], f, data_start, entry, a - offset)
            offset += n


def _read_into(dest: torch.Tensor, f, data_start: int, entry: dict, first: int) -> None:
    """Elements ``first .. first + len(dest)`` of a checkpoint tensor into ``dest`` (flat)."""
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    # read straight into the partition when it is a CPU tensor of the file's dtype, else through a host buffer
    buf = dest if dest.dtype == dtype and dest.device.type == "cpu" else torch.empty(dest.numel(), dtype=dtype)
    esize = buf.element_size()
    f.seek(data_start + entry["data_offsets"][0] + first * esize)
    if f.readinto(buf.view(torch.uint8).numpy()) != dest.numel() * esize:
        raise ConfigError(f"{f.name}: truncated tensor data")
    if buf is not dest:
        dest.copy_(buf)


# transformers (>= 5) fuses a mixture of experts' per-expert MLPs into [E, 2 I, H] gate-and-up and [E, H, I] down
# weights at load, from checkpoints that store them per expert: the per-expert names of each fused weight, for the
# layouts of its conversion mapping (Qwen2/3-MoE and the models mapped like them; Mixtral's w1/w3/w2)
EXPERT_LAYOUTS = {
    "gate_up_proj": [("{p}.experts.{e}.gate_proj.weight", "{p}.experts.{e}.up_proj.weight"),
                     ("{b}.experts.{e}.w1.weight", "{b}.experts.{e}.w3.weight")],
    "down_proj": [("{p}.experts.{e}.down_proj.weight",), ("{b}.experts.{e}.w2.weight",)],
}


def expert_pieces(name: str, shape: tuple[int, ...], stored: dict) -> list[str] | None:
    """The checkpoint names whose concatenation is the fused expert weight ``name`` (None: not one, or not stored
    per expert). Gate and up are concatenated along each expert's rows, so expert e's gate then up, e = 0, 1, ..."""
    prefix, sep, kind = name.rpartition(".experts.")
    if not sep or kind not in EXPERT_LAYOUTS:
        return None
    block = prefix.removesuffix(".mlp") + ".block_sparse_moe"  # Mixtral's name for the MLP block
    for layout in EXPERT_LAYOUTS[kind]:
        names = [t.format(p=prefix, b=block, e=e) for e in range(shape[0]) for t in layout]
        if all(n in stored for n in names):
            return names
    return None


def load_partitioned(cfg: Config, source: str, ds_config: dict) -> torch.nn.Module:
    """The model of ``source`` (an HF folder) built under ZeRO-3 partitioning; the built-in tiny model is
    built whole (DeepSpeed partitions it when its engine starts)."""
    import deepspeed
    from transformers import AutoConfig, GenerationConfig

    from grpo.foundation.lora import is_adapter_folder

    if source == BUILTIN_NAME or not Path(source).is_dir() or is_adapter_folder(source):
        return load_model(cfg.model, source)  # (an adapter folder: its base with the adapter merged in)
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
    text = config.get_text_config()
    tied_head = (text.vocab_size, text.hidden_size) if getattr(text, "tie_word_embeddings", False) else None
    init = _init_without_broadcast(tied_head)
    with init(config_dict_or_path=ds_config), no_init_weights():
        model = model_class(config, source).from_config(config, dtype=dtype, trust_remote_code=m.trust_remote_code,
                                                        **kwargs)
    model.tie_weights()  # skipped with the initialisation; tied weights are stored once in the files
    for head in init.deferred:
        if not hasattr(head.weight, "ds_id"):  # not tied after all: partitioned now, filled from the files below
            head.weight = torch.nn.Parameter(torch.empty(tied_head, dtype=dtype))
            deepspeed.zero.Init(module=head, config_dict_or_path=ds_config)
    params = dict(model.named_parameters())
    filled, rank = set(), dist.rank()
    stored = {}  # checkpoint name -> (file, data start, header entry)
    with contextlib.ExitStack() as files:
        for path in weight_files(Path(source)):
            data_start, header = safetensors_index(path)
            f = files.enter_context(open(path, "rb", buffering=0))
            stored.update({key: (f, data_start, entry) for key, entry in header.items()})
        renamed = legacy_names(model, stored)
        for key, param in params.items():
            names = [key] if key in stored else expert_pieces(key, tuple(param.ds_shape), stored)
            if not names and key in renamed:  # a multimodal checkpoint's own layout (language_model.model.*)
                names = [renamed[key]]
            if names:
                fill_pieces(param, [stored[n] for n in names], rank)
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


def legacy_names(model: torch.nn.Module, stored: dict) -> dict[str, str]:
    """{the model's name: the checkpoint's key} for the keys transformers renames at load (its conversion mapping's
    renamings: an image-text-to-text checkpoint is saved as ``language_model.model.*``, ``vision_tower.*``, and
    built as ``model.language_model.*``, ...); empty where this transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return {}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not renamings:
        return {}
    out = {}
    for key in stored:
        name = rename_source_key(key, renamings, [])[0]
        if name != key:
            out.setdefault(name, key)
    return out


def _init_without_broadcast(tied_head: tuple[int, int] | None = None):
    """``deepspeed.zero.Init`` that partitions each new weight without first broadcasting it from rank 0,
    and leaves a tied output head alone.

    The broadcast makes random initialisations agree; here every weight is then read from the files, and
    on the receiving ranks it would write each module's weights whole once (at 135M parameters the 113 MiB
    embedding, most of the partitioned build's peak there). Without it an uninitialised weight is never
    written whole, so it never becomes resident. (A DeepSpeed version without ``_zero_init_param`` keeps
    its broadcast: more transient memory, the same weights.)

    ``tied_head`` (vocabulary, hidden), for a model whose output head is tied to its input embeddings: the
    head's own weight, a bias-less Linear of that shape, is replaced by the embeddings' at ``tie_weights()``.
    Partitioned, it would hold a vocabulary-sized share on every rank until then (54 MiB per rank of
    SmolLM2-135M over 2 ranks, the partitioned build's peak above half the whole one); instead its weight
    is dropped at once (an empty placeholder: on a GPU the whole weight that ``nn.Linear`` allocated is
    freed, on a CPU it was never written, so never resident). Such heads are listed in ``deferred``; one
    still untied after ``tie_weights()`` gets its weight back and is partitioned then."""
    import deepspeed

    class Init(deepspeed.zero.Init):
        deferred: list[torch.nn.Module] = []

        def _zero_init_param(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()

        def _post_init_method(self, module):
            weight = getattr(module, "weight", None)
            if (tied_head is not None and isinstance(module, torch.nn.Linear) and module.bias is None
                    and weight is not None and tuple(weight.shape) == tied_head and not hasattr(weight, "ds_id")):
                Init.deferred.append(module)
                module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=weight.requires_grad)
                return
            super()._post_init_method(module)

    return Init


def frozen_partitioned(cfg: Config, source: str, ds_config: dict) -> torch.nn.Module:
    """A frozen model (the in-process reference) kept partitioned over the ranks by an optimizer-less
    ZeRO-3 engine: each rank holds 1/world of its weights, and its forwards are collective."""
    import deepspeed

    model = load_partitioned(cfg, source, ds_config)
    model.requires_grad_(False)
    conf = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}
    engine, *_ = deepspeed.initialize(model=model, config=conf)
    engine.module.eval()
    # the engine owns the gathering hooks: it lives as long as the module (a plain attribute, not a submodule,
    # so the module's state_dict, train() and modules() do not walk into it)
    engine.module.__dict__["_grpo_engine"] = engine
    return engine.module
