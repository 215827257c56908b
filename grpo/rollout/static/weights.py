"""The tensors a static step reads (``Weights``), taken from the module at every call: the per-layer keys of each
family (``LAYER_KEYS``) and the model-level extras."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo.rollout.static import delta_net, gemma3n
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
    def unflat(cls, flat: list[Optional[torch.Tensor]], rope_scale: tuple[float, ...], n_extra: int = 0) -> "Weights":
        n, first = len(LAYER_KEYS), 4 + n_extra + len(rope_scale)
        layers = [dict(zip(LAYER_KEYS, flat[i: i + n])) for i in range(first, len(flat), n)]
        return cls(embed=flat[0], layers=layers, norm=flat[1], head=flat[2], embed_scale=flat[3],
                   extra=tuple(flat[4: 4 + n_extra]), ropes=list(flat[4 + n_extra: first]), rope_scale=rope_scale)

    def pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.flat() if t is not None)


LAYER_KEYS = {
    "q": "self_attn.q_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k": "self_attn.k_proj.weight", "k_bias": "self_attn.k_proj.bias",
    "v": "self_attn.v_proj.weight", "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "in_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "pre_ff_norm": "pre_feedforward_layernorm.weight", "post_ff_norm": "post_feedforward_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "gate_bias": "mlp.gate_proj.bias",
    "up": "mlp.up_proj.weight", "up_bias": "mlp.up_proj.bias",
    "down": "mlp.down_proj.weight", "down_bias": "mlp.down_proj.bias",
    # mixture of experts: the router, the experts' [E, 2 I, H] gate-and-up and [E, H, I] down weights, Qwen2-MoE's
    # shared expert and its gate
    "router": "mlp.gate.weight", "experts_gate_up": "mlp.experts.gate_up_proj", "experts_down": "mlp.experts.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj.weight", "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight", "shared_expert_gate": "mlp.shared_expert_gate.weight",
    **delta_net.LAYER_KEYS,  # Qwen3.5's linear-attention layers
    **gemma3n.LAYER_KEYS,  # Gemma 3n's AltUp and LAuReL
    # Gemma 4: its per-layer input's gate, projection and norm; the layer's output scalar (a buffer, read from the
    # module)
    "ple_gate": "per_layer_input_gate.weight", "ple_proj": "per_layer_projection.weight",
    "ple_norm": "post_per_layer_input_norm.weight", "layer_scalar": "layer_scalar",
    # Gemma 4's mixture of experts beside the MLP: its router, experts and norms
    "g4_router": "router.proj.weight", "g4_router_scale": "router.scale", "g4_expert_scale": "router.per_expert_scale",
    "g4_experts_gate_up": "experts.gate_up_proj", "g4_experts_down": "experts.down_proj",
    "pre_ff_norm_2": "pre_feedforward_layernorm_2.weight", "post_ff_norm_1": "post_feedforward_layernorm_1.weight",
    "post_ff_norm_2": "post_feedforward_layernorm_2.weight",
    # Llama 4's router (its experts: experts_gate_up [E, H, 2 I] and experts_down [E, I, H], transposed against the
    # others')
    "l4_router": "mlp.router.weight",
    # Phi-3 / Phi-4's fused projections: q, k, v in one; gate and up in one
    "qkv": "self_attn.qkv_proj.weight", "gate_up": "mlp.gate_up_proj.weight",
    # Mistral 4's latent attention: the query's low-rank pair and its norm, the latent's projection, norm and expansion
    "q_a": "self_attn.q_a_proj.weight", "q_a_bias": "self_attn.q_a_proj.bias",
    "q_a_norm": "self_attn.q_a_layernorm.weight", "q_b": "self_attn.q_b_proj.weight", "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_bias": "self_attn.kv_a_proj_with_mqa.bias", "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "kv_b": "self_attn.kv_b_proj.weight",
}


def read_weights(model: torch.nn.Module, spec: ModelSpec, named: dict[str, torch.Tensor]) -> Weights:
    """``named``: transformers' names -> tensors (``named_parameters`` or a LoRA-merged state dict)."""
    # Llama 4 calls its MLP feed_forward, Mistral 4 its shared expert shared_experts (then both have Qwen2-MoE's names)
    named = {k.removeprefix("base_model.model.").replace(".feed_forward.", ".mlp.")
             .replace(".mlp.shared_experts.", ".mlp.shared_expert."): v for k, v in named.items()}
    top = "model.language_model." if "model.language_model.embed_tokens.weight" in named else "model."
    embed = named[f"{top}embed_tokens.weight"]
    layers = [{key: named.get(f"{top}layers.{i}.{name}") for key, name in LAYER_KEYS.items()}
              for i in range(spec.layers)]
    rotary = _rotary(model)
    types = getattr(rotary, "layer_types", None) or [None]
    prefix = [f"{t}_" if t else "" for t in types]
    decoder = _decoder(model)
    scale = getattr(decoder.embed_tokens, "embed_scale", None)  # Gemma's (a buffer: ZeRO-3 leaves it whole)
    extra: tuple = ()
    for i, lw in enumerate(layers):  # buffers, read from the module: Gemma 4's layer scalars, Gemma 3n's router scale
        lw["layer_scalar"] = getattr(decoder.layers[i], "layer_scalar", None)
        if spec.altup:
            lw["altup_router_scale"] = decoder.layers[i].altup.router_input_scale
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


def extra_count(spec: ModelSpec) -> int:
    """How many model-level tensors ``Weights.extra`` holds for this model."""
    return (6 + 2 * (spec.altup[0] - 1)) if spec.altup else (4 if spec.per_layer_dim else 0)
