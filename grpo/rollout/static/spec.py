"""Which models the static engine runs, and what it reads from their configs: ``ModelSpec`` (one per model), built by
``model_spec``; ``unsupported_reason`` says why a model is not run (the ``hf`` engine takes it then). The family
facts (model types, norms, RoPE types, per-family fields) live here; the package docstring lists the families."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from grpo.foundation import lora
from grpo.foundation.families import logit_scale, text_config
from grpo.rollout.static import attention, blocks, delta_net, gemma3n, mlp as mlps
from grpo.rollout.static.norms import rms_norm

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # transformers' ACT2FN names
    "silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
}
# RoPE types whose frequencies do not depend on the sequence length: inv_freq and the cos/sin scale are read
# from the model's rotary module once. ("dynamic" and "longrope" change with the length: not supported.)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")  # proportional: Gemma 4's partial RoPE
LENGTH_BUCKET = 64  # KV buffers are allocated in multiples of this many columns


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    windows: tuple[Optional[int], ...]  # per layer: sliding window (keys with q_pos - k_pos < window), None: full
    qk_norm: bool
    act: str = "silu"  # the MLP's gate activation (a key of ACTIVATIONS)
    scale: Optional[float] = None  # attention scale (None: head_dim ** -0.5)
    gemma_norm: bool = False  # RMSNorm as Gemma's: (x_hat * (1 + w)) in float32, then cast
    attn_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    rope_of_layer: Optional[tuple[int, ...]] = None  # per layer: which of Weights.ropes (None: the one)
    experts_per_token: int = 0  # MoE: the router's top-k (0: dense MLPs; a layer with a router is a MoE layer)
    renorm_topk: bool = False  # MoE: the top-k routing weights renormalised to sum to 1
    fp32_routing: bool = False  # MoE: routing weights kept in float32 (Mixtral), else cast to the model's dtype
    rope_layers: Optional[tuple[bool, ...]] = None  # per layer: RoPE applied (SmolLM3's NoPE layers: False; None: all)
    q_scale: Optional[tuple[float, int]] = None  # Ministral 3: queries x (1 + beta log(1 + floor(pos / n))), (beta, n)
    attn_gate: bool = False  # Qwen3.5: q_proj also gives a gate, the attention's output x sigmoid(gate)
    linear: Optional[tuple[bool, ...]] = None  # per layer: a Gated DeltaNet layer (Qwen3.5; None: none)
    delta: Optional[delta_net.DeltaSpec] = None  # the Gated DeltaNet layers' sizes
    # Gemma 4: per layer (kv_heads, head_dim) (its full-attention layers' differ), the layer whose KV buffers it
    # reads (its own, or the last earlier layer of its type: KV sharing), keys = values before their norms
    # (attention_k_eq_v), values RMS-normed without a weight, RMSNorm weights multiplied in float32, per-layer
    # inputs (PLE) of this width, a scalar multiplying each layer's output
    layer_dims: Optional[tuple[tuple[int, int], ...]] = None
    kv_source: Optional[tuple[int, ...]] = None
    k_eq_v: Optional[tuple[bool, ...]] = None
    v_norm: bool = False
    norm_f32: str = ""  # RMSNorm weights multiplied in float32, the inverse RMS by "pow" (Gemma 3n, 4) or "rsqrt" (OLMo)
    per_layer_dim: int = 0
    # Llama 4: RoPE on interleaved pairs (complex products in float32), queries and keys L2-normed after it,
    # per layer the attention chunk (keys in the query's chunk of this many positions; None: all), the query
    # scale of NoPE layers (attn_scale, floor_scale: 1 + attn_scale log(1 + floor((pos + 1) / floor_scale)))
    rope_interleaved: bool = False
    qk_l2: bool = False
    chunks: Optional[tuple[Optional[int], ...]] = None
    attn_temperature: Optional[tuple[float, float]] = None
    # Mistral 4: multi-head latent attention (qk_nope_head_dim, qk_rope_head_dim, v_head_dim; keys and values
    # expanded from the normed latent once, as they enter the buffers), its RoPE on interleaved pairs (DeepSeek's
    # layout), group-limited routing (n_group, topk_group, routed_scaling_factor)
    mla: Optional[tuple[int, int, int]] = None
    mla_interleave: bool = False
    grouped_routing: Optional[tuple[int, int, float]] = None
    # Gemma 3n (gemma3n.py): AltUp (altup_num_inputs, altup_active_idx, altup_correct_scale), per layer the MLP's
    # activation-sparsity quantile (gemma3n.quantile, in the model's dtype; None: dense), the per-layer inputs'
    # vocabulary
    altup: Optional[tuple[int, int, bool]] = None
    sparsity: Optional[tuple[Optional[float], ...]] = None
    per_layer_vocab: int = 0
    # Granite 3: the embeddings' multiplier, each residual branch's, the logits' divisor
    granite: Optional[tuple[float, float]] = None  # Granite 3: the embedding and residual multipliers
    logit_scale: float = 1.0  # what the causal-LM forward multiplies its logits by (families.HEADS)
    qk_norm_full: bool = False  # OLMo 2 / 3, OLMoE: q and k RMS-normed over the whole projection, before the heads split
    # the family's layer shape (blocks.py), attention inputs (attention.py: its projections and what becomes of
    # them) and MLP (mlp.py),
    # the layer weights it reads (the engine's key, transformers' name under
    # ``layers.<i>.``: BASE_KEYS and the family's own) and its renames of transformers' names as they are read
    block: Callable = blocks.pre_norm
    project: Callable = attention.separate
    qkv: Callable = attention.heads
    mlp: Callable = mlps.gated
    layer_keys: tuple[tuple[str, str], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    def rope_on(self, i: int) -> bool:
        """Whether layer ``i`` applies RoPE (SmolLM3's and Llama 4's NoPE layers do not)."""
        return self.rope_layers is None or self.rope_layers[i]

    def norm(self, x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
        """This model's RMSNorm (``rms_norm`` in its family's arithmetic)."""
        return rms_norm(x, weight, self.eps, self.gemma_norm, self.norm_f32)


def unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """Why the static engine cannot run ``model`` (None: it can)."""
    if lora.has_lora(model):
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
    outer = getattr(model, "config", None)
    cfg = text_config(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} is not one of the static engine's families {list(MODEL_TYPES)}"
    if activation(cfg) not in ACTIVATIONS:
        return f"hidden activation {activation(cfg)!r}: the static engine's gated MLP has {list(ACTIVATIONS)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    # Gemma 3: one set of RoPE parameters per layer type
    for params in (rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]):
        rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
        if rope_type not in ROPE_TYPES:
            return (f"RoPE type {rope_type!r} depends on the sequence length: the static engine supports "
                    f"{list(ROPE_TYPES)}")
    if FAMILIES[kind].block is not blocks.sandwich and getattr(cfg, "attn_logit_softcapping", None):
        return (f"attn_logit_softcapping={cfg.attn_logit_softcapping} on a {kind} model: the static engine caps "
                f"Gemma 2/3's attention only")
    if getattr(cfg, "use_bidirectional_attention", None) not in (None, False, "vision"):  # Gemma 4: images only
        return "use_bidirectional_attention: the static engine decodes causally"
    if getattr(outer, "quantization_config", None) or getattr(cfg, "quantization_config", None):
        return "quantized weights: the static engine multiplies by the weights as they are stored"
    unread = unread_weights(model, FAMILIES[kind])
    if unread:
        return (f"{len(unread)} layer weights its {kind} family does not read ({', '.join(unread[:3])}"
                f"{', ...' if len(unread) > 3 else ''}): the static engine would decode without them")
    return None


def unread_weights(model: torch.nn.Module, family: "Family") -> list[str]:
    """The decoder layers' parameters that ``family``'s layer weights (BASE_KEYS and its ``keys``, after its
    ``renames``) leave out: a model whose config adds weights the table does not know is not run. A LoRA adapter's
    own parameters are not the model's (its base layers are read merged)."""
    known = set(BASE_KEYS.values()) | set(family.keys.values())
    unread = []
    for i, layer in enumerate(_decoder(model).layers):
        for name, _ in layer.named_parameters():
            if "lora_" in name:
                continue
            name = "." + name.replace(".base_layer.", ".")
            for old, new in family.renames:
                name = name.replace(old, new)
            if name[1:] not in known:
                unread.append(f"layers.{i}{name}")
    return unread


def activation(cfg) -> str:
    """The MLP's activation name (Gemma 2/3 call it ``hidden_activation``)."""
    return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers decoder stack (``model.model``, or its ``language_model`` in a multimodal checkpoint; under
    a PeftModel wrapper, its base's)."""
    inner = model.model if hasattr(model, "model") else model.get_base_model().model
    return getattr(inner, "language_model", inner)


def _rotary(model: torch.nn.Module) -> torch.nn.Module:
    return _decoder(model).rotary_emb


def model_spec(model: torch.nn.Module) -> ModelSpec:
    cfg = text_config(model)
    family = FAMILIES[cfg.model_type]
    heads = cfg.num_attention_heads
    first = cfg.per_layer_config[0] if family.per_layer_sizes else cfg  # Gemma 4: sizes per layer (its fields)
    head_dim = getattr(first, "head_dim", None) or cfg.hidden_size // heads
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    windows = tuple(
        (window if (layer_types is None or layer_types[i] == "sliding_attention") else None)
        for i in range(cfg.num_hidden_layers)
    )
    rope_types = getattr(_rotary(model), "layer_types", None)  # Gemma 3: a RoPE per layer type
    fields = dict(
        layers=cfg.num_hidden_layers, heads=heads, kv_heads=getattr(first, "num_key_value_heads", None) or heads,
        head_dim=head_dim, eps=cfg.rms_norm_eps, windows=windows, qk_norm=family.qk_norm, act=activation(cfg),
        scale=(cfg.query_pre_attn_scalar if family.query_pre_attn_scalar else head_dim) ** -0.5,
        gemma_norm=family.gemma_norm,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
        rope_of_layer=tuple(rope_types.index(t) for t in layer_types) if rope_types else None,
        experts_per_token=getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "top_k_experts", 0) or 0,
        renorm_topk=family.renorm_topk or bool(getattr(cfg, "norm_topk_prob", False)),
        fp32_routing=family.fp32_routing,
        rope_layers=tuple(bool(x) for x in cfg.no_rope_layers) if family.no_rope_layers else None,
        q_scale=((cfg.rope_parameters["llama_4_scaling_beta"], cfg.rope_parameters["original_max_position_embeddings"])
                 if family.q_scale else None),
        attn_gate=family.hybrid,
        linear=tuple(t == "linear_attention" for t in layer_types) if family.hybrid else None,
        delta=delta_net.delta_spec(cfg) if family.hybrid else None,
        logit_scale=logit_scale(model),  # one place says it for the trainer's log-probs and this engine
        block=family.block, project=family.project, qkv=family.qkv, mlp=family.mlp, layer_keys=tuple({**BASE_KEYS, **family.keys}.items()), renames=family.renames,
    )
    if family.fields is not None:
        fields.update(family.fields(cfg, model))
    return ModelSpec(**fields)


def gemma3n_fields(cfg, dtype: torch.dtype) -> dict:
    """Gemma 3n's ModelSpec fields: KV sharing, value norms, its norms, scale 1, per-layer inputs, AltUp, the MLPs'
    sparsity quantiles in the model's dtype."""
    return dict(**kv_sharing(cfg), v_norm=True, norm_f32="pow", scale=1.0, per_layer_dim=cfg.hidden_size_per_layer_input,
                per_layer_vocab=cfg.vocab_size_per_layer_input,
                altup=(cfg.altup_num_inputs, cfg.altup_active_idx, bool(cfg.altup_correct_scale)),
                sparsity=tuple(gemma3n.quantile(float(s), dtype) for s in cfg.activation_sparsity_pattern))


def mistral4_fields(cfg, decoder: torch.nn.Module) -> dict:
    """Mistral 4's ModelSpec fields: MLA's sizes, its keys' and values' heads (every query head's own), its
    attention scale (the layer's: YaRN's mscale squared), group-limited routing."""
    return dict(mla=(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim),
                mla_interleave=bool(cfg.rope_interleave), kv_heads=cfg.num_attention_heads,
                head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                scale=float(decoder.layers[0].self_attn.scaling),
                grouped_routing=(cfg.n_group, cfg.topk_group, float(cfg.routed_scaling_factor)))


def llama4_fields(cfg) -> dict:
    """Llama 4's ModelSpec fields: NoPE layers (``no_rope_layers[i]`` 0), chunked attention on its RoPE layers, the
    NoPE layers' query scale."""
    return dict(rope_interleaved=True, qk_l2=bool(cfg.use_qk_norm),
                chunks=tuple(cfg.attention_chunk_size if t == "chunked_attention" else None for t in cfg.layer_types),
                attn_temperature=(cfg.attn_scale, cfg.floor_scale) if cfg.attn_temperature_tuning else None)


def kv_sharing(cfg) -> dict:
    """Gemma 3n's and 4's KV sharing: the last ``num_kv_shared_layers`` layers read the KV of the last earlier layer
    of their type. Computed from those two fields, as transformers' attention did up to 5.17 (5.24's config derives
    the same from them as ``kv_sharing_modes``, which 5.17's has not)."""
    types, n = cfg.layer_types, cfg.num_hidden_layers
    first = n - (getattr(cfg, "num_kv_shared_layers", 0) or 0)
    if first <= 0:  # transformers shares nothing then (3n) or has no layer to read from (4)
        raise ValueError(f"num_kv_shared_layers={cfg.num_kv_shared_layers} of {n} layers: no layer keeps its own KV")
    store = {t: i for i, t in enumerate(types[:first])}  # the last one of each type
    return dict(kv_source=tuple(i if i < first else store[types[i]] for i in range(n)))


def gemma4_fields(cfg) -> dict:
    """Gemma 4's ModelSpec fields from its config: per-layer sizes, KV sharing (a "reuse" layer reads the KV of
    the "store" layer of its type), keys = values on full-attention layers under ``attention_k_eq_v``."""
    types = cfg.layer_types
    dims = [(cfg.per_layer_config[i].num_key_value_heads, cfg.per_layer_config[i].head_dim)
            for i in range(cfg.num_hidden_layers)]
    return dict(layer_dims=tuple(dims), **kv_sharing(cfg),
                k_eq_v=tuple(bool(cfg.attention_k_eq_v) and t != "sliding_attention" for t in types),
                v_norm=True, norm_f32="pow", per_layer_dim=cfg.hidden_size_per_layer_input or 0,
                scale=1.0)  # its q/k norms set the scale


def olmo_fields(cfg, model: torch.nn.Module) -> dict:
    """OLMo 2's and 3's ModelSpec fields: their norms' float32 arithmetic, q/k norms over the whole projection."""
    return dict(norm_f32="rsqrt", qk_norm_full=True)


def granite_fields(cfg, model: torch.nn.Module) -> dict:
    """Granite 3's ModelSpec fields: its attention multiplier as the scale; its embedding and residual multipliers
    (its logits' division is the model's logit_scale, as the trainer's log-probs read it)."""
    return dict(scale=float(cfg.attention_multiplier), granite=(
        float(cfg.embedding_multiplier), float(cfg.residual_multiplier)))


# ----------------------------------------------------------------------------- the families


# every family's layer weights (the engine's key -> transformers' name under ``layers.<i>.``): attention, its q/k
# norms, the norms around attention and MLP, the dense gated MLP. A family adds its own (``Family.keys``).
BASE_KEYS = {
    "q": "self_attn.q_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k": "self_attn.k_proj.weight", "k_bias": "self_attn.k_proj.bias",
    "v": "self_attn.v_proj.weight", "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "in_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "pre_ff_norm": "pre_feedforward_layernorm.weight", "post_ff_norm": "post_feedforward_layernorm.weight",
    **mlps.DENSE_KEYS,
}
# Gemma 4: its per-layer input's gate, projection and norm, its layer's output scalar (a buffer, read from the
# module), the experts beside its MLP
GEMMA4_KEYS = {**gemma3n.PLE_KEYS, "layer_scalar": "layer_scalar", **mlps.GEMMA4_KEYS}


@dataclass(frozen=True)
class Family:
    """What one model type is to the static engine: the flags its step reads and the ModelSpec fields its config
    gives (``fields``: ``(text config, model) -> dict``), its MLP (mlp.py), the layer weights it reads beyond
    BASE_KEYS and its renames of transformers' names. Adding a decoder family is an entry of FAMILIES (and at most
    a layer function, docs/architecture.md "Extending")."""

    gemma_norm: bool = False  # RMSNorm x (1 + w) in float32, embeddings scaled by sqrt(hidden)
    qk_norm: bool = False  # q and k RMS-normed per head
    query_pre_attn_scalar: bool = False  # the attention scale is query_pre_attn_scalar ** -0.5
    renorm_topk: bool = False  # the router's top-k weights renormalised, whatever norm_topk_prob says
    fp32_routing: bool = False  # the router's softmax in float32
    no_rope_layers: bool = False  # no_rope_layers[i] = 0 marks a layer without RoPE
    q_scale: bool = False  # a position-dependent query scale (rope_parameters' llama_4_scaling_beta)
    hybrid: bool = False  # Gated DeltaNet layers (delta_net.py) between attention layers with an output gate
    per_layer_sizes: bool = False  # head sizes per layer (per_layer_config)
    fields: Optional[Callable[[Any, torch.nn.Module], dict]] = None
    block: Callable = blocks.pre_norm  # its layer's shape: blocks.pre_norm, .sandwich (soft-capping), gemma3n.block
    project: Callable = attention.separate  # its q, k, v projections: attention.separate, .fused
    qkv: Callable = attention.heads  # its queries, keys and values from them: attention.heads, .latent
    mlp: Callable = mlps.gated  # its MLP: mlp.gated, .fused, .moe, .llama4, .gemma4
    keys: Mapping[str, str] = field(default_factory=dict)  # its layer weights beyond BASE_KEYS
    renames: tuple[tuple[str, str], ...] = ()  # (old, new): parts of transformers' names it reads as another's


def _moe(keys: Mapping[str, str] = {}, **flags) -> Family:
    """A mixture-of-experts family (its layers without a router are dense)."""
    return Family(mlp=mlps.moe, keys={**keys, **mlps.MOE_KEYS}, **flags)


# Qwen3.5's, Qwen3-Next's hybrid decoders: (1 + w) norms too
_HYBRID = dict(gemma_norm=True, qk_norm=True, hybrid=True, keys=delta_net.LAYER_KEYS)
# qwen2_vl_text / qwen2_5_vl_text / qwen3_vl_text / qwen3_vl_moe_text: the VL checkpoints' language models, Qwen2's,
# Qwen3's and Qwen3-MoE's decoders whose multimodal RoPE gives text its three position streams equal: the plain RoPE
FAMILIES: dict[str, Family] = {
    "llama": Family(), "mistral": Family(), "ministral": Family(), "ministral3": Family(q_scale=True),
    "mixtral": _moe(renorm_topk=True, fp32_routing=True),
    "qwen2": Family(), "qwen2_moe": _moe(), "qwen3": Family(qk_norm=True), "qwen3_moe": _moe(qk_norm=True),
    "gemma": Family(gemma_norm=True), "gemma2": Family(gemma_norm=True, block=blocks.sandwich,
                                                       query_pre_attn_scalar=True),
    "gemma3_text": Family(gemma_norm=True, block=blocks.sandwich, qk_norm=True, query_pre_attn_scalar=True),
    "smollm3": Family(no_rope_layers=True),
    "qwen2_vl_text": Family(), "qwen2_5_vl_text": Family(), "qwen3_vl_text": Family(qk_norm=True),
    "qwen3_vl_moe_text": _moe(qk_norm=True, renorm_topk=True),  # Qwen3-VL-MoE's text model
    "qwen3_5_text": Family(**_HYBRID),
    "qwen3_5_moe_text": _moe(**_HYBRID, renorm_topk=True), "qwen3_next": _moe(**_HYBRID),
    "gemma4_text": Family(block=blocks.sandwich, qk_norm=True, per_layer_sizes=True, mlp=mlps.gemma4, keys=GEMMA4_KEYS,
                          fields=lambda cfg, model: gemma4_fields(cfg)),
    "llama4_text": Family(no_rope_layers=True, mlp=mlps.llama4, keys=mlps.LLAMA4_KEYS,
                          renames=((".feed_forward.", ".mlp."),), fields=lambda cfg, model: llama4_fields(cfg)),
    "mistral4": _moe(q_scale=True, qkv=attention.latent, keys=attention.LATENT_KEYS,
                     renames=((".mlp.shared_experts.", ".mlp.shared_expert."),),
                     fields=lambda cfg, model: mistral4_fields(cfg, _decoder(model))),
    "gemma3n_text": Family(block=gemma3n.block, qk_norm=True, keys={**gemma3n.LAYER_KEYS, **gemma3n.PLE_KEYS},
                           fields=lambda cfg, model: gemma3n_fields(cfg, next(model.parameters()).dtype)),
    "olmo2": Family(block=blocks.sandwich, fields=olmo_fields),
    "olmo3": Family(block=blocks.sandwich, fields=olmo_fields),
    "olmoe": _moe(fields=lambda cfg, model: dict(qk_norm_full=True)),
    "phi3": Family(project=attention.fused, mlp=mlps.fused, keys={**attention.FUSED_QKV_KEYS, **mlps.FUSED_KEYS}),
    "seed_oss": Family(),  # ByteDance's Seed-OSS: Llama's layers with biased q, k and v
    "granite": Family(fields=granite_fields),
}
MODEL_TYPES = tuple(FAMILIES)
