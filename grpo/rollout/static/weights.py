"""The tensors a static step reads (``Weights``), taken from the module at every call: the per-layer keys of each
family (``LAYER_KEYS``) and the model-level extras."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo.rollout.static import gemma3n
from grpo.rollout.static.spec import ModelSpec, _decoder, _rotary


@dataclass
class Weights:
    """The tensors one step reads: per layer a dict (``q``/``k``/``v``/``o`` weight and bias, ``q_norm``,
    ``k_norm``, ``in_norm``, ``post_norm``, ``gate``/``up``/``down``), and the embedding, final norm, head."""

    embed: torch.Tensor
    layers: list[dict[str, Optional[torch.Tensor]]]
    norm: torch.Tensor
    head: torch.Tensor
    ropes: list[torch.Tensor]  # inv_freq of each RoPE (one; Gemma 3: one per layer type)
    rope_scale: tuple[float, ...]  # the cos/sin scale of each
    embed_scale: Optional[torch.Tensor] = None  # Gemma: the embedding's multiplier, in the embedding's dtype
    # model-level tensors of Gemma 4 and 3n (``extra_count``): the per-layer inputs' embedding and its multiplier,
    # the projection of the embeddings and its norm; Gemma 3n's two scales of them and its AltUp projections
    extra: tuple[Optional[torch.Tensor], ...] = ()

    def flat(self) -> list[Optional[torch.Tensor]]:
        """Every tensor in a fixed order (a compiled step takes them as a list: its guards then check tensors,
        never the identity of this object)."""
        return ([self.embed, self.norm, self.head, self.embed_scale, *self.extra, *self.ropes]
                + [t for layer in self.layers for t in layer.values()])

    @classmethod
    def unflat(cls, flat: list[Optional[torch.Tensor]], rope_scale: tuple[float, ...], spec: ModelSpec) -> "Weights":
        keys = [key for key, _ in spec.layer_keys]
        n_extra = extra_count(spec)
        n, first = len(keys), 4 + n_extra + len(rope_scale)
        layers = [dict(zip(keys, flat[i: i + n])) for i in range(first, len(flat), n)]
        return cls(embed=flat[0], layers=layers, norm=flat[1], head=flat[2], embed_scale=flat[3],
                   extra=tuple(flat[4: 4 + n_extra]), ropes=list(flat[4 + n_extra: first]), rope_scale=rope_scale)

    def pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.flat() if t is not None)


def read_weights(model: torch.nn.Module, spec: ModelSpec, named: dict[str, torch.Tensor]) -> Weights:
    """``named``: transformers' names -> tensors (``named_parameters`` or a LoRA-merged state dict). Each layer's
    weights are those its family reads (``spec.layer_keys``); a name that is no parameter is a buffer of the layer's
    module (Gemma 4's layer scalar, Gemma 3n's router scale: ZeRO-3 leaves buffers whole)."""
    def renamed(name: str) -> str:
        name = name.removeprefix("base_model.model.")
        for old, new in spec.renames:  # Llama 4's feed_forward is an mlp, Mistral 4's shared_experts a shared_expert
            name = name.replace(old, new)
        return name

    named = {renamed(k): v for k, v in named.items()}
    top = "model.language_model." if "model.language_model.embed_tokens.weight" in named else "model."
    embed = named[f"{top}embed_tokens.weight"]
    decoder = _decoder(model)
    def read(i: int, name: str) -> Optional[torch.Tensor]:  # a parameter, else a buffer of the layer's module
        full = f"{top}layers.{i}.{name}"
        return named[full] if full in named else _buffer(decoder.layers[i], name)

    layers = [{key: read(i, name) for key, name in spec.layer_keys} for i in range(spec.layers)]
    rotary = _rotary(model)
    types = getattr(rotary, "layer_types", None) or [None]
    prefix = [f"{t}_" if t else "" for t in types]
    scale = getattr(decoder.embed_tokens, "embed_scale", None)  # Gemma's (a buffer: ZeRO-3 leaves it whole)
    extra: tuple = ()
    if spec.per_layer_dim:  # Gemma 4's and 3n's per-layer inputs (the embedding's multiplier a buffer, as above)
        pe = named[f"{top}embed_tokens_per_layer.weight"]
        extra = (pe, decoder.embed_tokens_per_layer.embed_scale.to(pe.device, pe.dtype),
                 named[f"{top}per_layer_model_projection.weight"], named[f"{top}per_layer_projection_norm.weight"])
    if spec.altup:  # Gemma 3n: the per-layer inputs' scales (buffers), the AltUp projections in and out
        extra += (decoder.per_layer_projection_scale, decoder.per_layer_input_scale,
                  *(named[name] for name in gemma3n.extra_names(top, spec.altup[0])[2:]))
    return Weights(embed=embed, layers=layers, norm=named[f"{top}norm.weight"],
                   head=named.get("lm_head.weight", embed), ropes=[getattr(rotary, f"{p}inv_freq") for p in prefix],
                   rope_scale=tuple(float(getattr(rotary, f"{p}attention_scaling", 1.0)) for p in prefix),
                   embed_scale=None if scale is None else scale.to(embed.device, embed.dtype), extra=extra)


def _buffer(module: torch.nn.Module, path: str) -> Optional[torch.Tensor]:
    """The buffer at ``path`` (dotted) under ``module``; None when there is none (a parameter the checkpoint lacks,
    or a renamed one, is never read from the module: under ZeRO-3 it would be a partition)."""
    for part in path.split("."):
        module = getattr(module, part, None)
    return module if isinstance(module, torch.Tensor) and not isinstance(module, torch.nn.Parameter) else None


def extra_count(spec: ModelSpec) -> int:
    """How many model-level tensors ``Weights.extra`` holds for this model."""
    return (6 + 2 * (spec.altup[0] - 1)) if spec.altup else (4 if spec.per_layer_dim else 0)
