"""The ``static`` engine: decoding over static KV buffers with a functional step over the policy's own weights.

Built for a GPU (``rollout.engine: auto`` picks it on CUDA for the model families below; see docs/gpu.md) and
exact on a CPU too, where it runs eager. Read top to bottom:

* ``ModelSpec`` / ``unsupported_reason``: which models it runs (the Llama, Mistral (Ministral 1 and 3, Mixtral, 4),
  Qwen2, Qwen3 (their MoE models too), Gemma 1-4 and 3n, Llama 4 and SmolLM3 lines: grouped-query attention, q/k/v/o and MLP
  biases, q/k RMSNorms, RoPE with a position-independent scaling (one per layer type for Gemma 3; none on SmolLM3's
  NoPE layers; Ministral 3's position-dependent query scale), SiLU or GELU-tanh gated MLP, tied or untied head,
  sliding windows; Gemma's (1 + w) RMSNorm, scaled embedding, norms around attention and MLP, attention-logit and
  final-logit soft-capping; Gemma 3's, Mistral 3's, LLaVA's and Qwen's VL checkpoints through their text model;
  mixture-of-experts MLPs with a softmax top-k router and Qwen2-MoE's gated shared expert, every expert applied
  to every token in one batched GEMM, so a decode step keeps static shapes and reads each expert's weights once;
  Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's hybrid decoders: Gated DeltaNet layers (delta_net.py; their two
  buffers per layer are a convolution window and a recurrent state instead of keys and values) between attention
  layers whose q_proj also gives an output gate, with a partial RoPE; Gemma 4: per-layer head sizes, keys =
  values, value norms, KV sharing (a layer's buffers are an earlier layer's), per-layer inputs and output
  scalars, its MoE models' experts beside the MLP; Llama 4's text models: interleaved RoPE, q/k L2 norms,
  chunked attention, the NoPE layers' query scale, its MoE layers; Mistral 4: latent attention, grouped
  routing; Gemma 3n's text models through gemma3n.py; OLMo 2 and 3 (post-norms, q/k norms over the projection)
  and OLMoE; Phi-3 / Phi-4's fused projections; Granite 3's multipliers); anything else gets a reason and the
  ``hf`` engine.
* ``Weights``: the tensors the step reads, taken from the module at every call (so a moved weight is always seen);
  a LoRA policy is read through an engine-owned merged copy, refreshed at ``sync_weights``; ZeRO-3 (below).
* ``forward``: one functional pass (prefill or decode) independent of transformers' cache, mask and generate
  code. KV buffers are [layers, rows, kv_heads, max_len, head_dim]; every row of a call writes the same column,
  and carries its own position; ``kpos`` [rows, max_len] holds the position of every written column (-1: left
  padding or not written yet), and the attention mask is built from positions alone (key position <= query
  position, within the sliding window), so ragged left-padded prompts need no other bookkeeping.
* ``StaticEngine.generate``: prefill each prompt once, copy its KV to its G rows, then decode. The rows are padded
  to a rows bucket, keys are read up to a length bucket (``rollout.static.length_bucket`` columns), the uniforms
  of every step are drawn up front from the engine's seeded ``torch.Generator`` (row r uses column r whatever the
  bucket, so tokens do not depend on buckets or compaction), and the host reads which rows finished once every ``check_every`` steps
  through a non-blocking copy (into pinned memory on CUDA) that it waits for only after the next step is queued.
  When the live rows fit a smaller bucket they are moved there (compaction).
* ``rollout.static.mode``: ``eager``, ``compile`` (torch.compile of the decode step's forward), ``graphs`` (a CUDA graph per
  (rows bucket, length bucket)), ``compile+graphs``; ``auto`` = graphs on CUDA, eager elsewhere (measured on an H200
  with torch 2.11: graphs 12.8-12.9k tokens/s at the 1.7B shape, 1.4-3.4 s of captures; compile+graphs 20.1k, but
  it compiles once per length bucket: 67 s of warm-up at 256 new tokens; docs/results.md). Graphs hold
  pointers: every call compares each weight's ``data_ptr`` with the captured ones and recaptures on a change.

``Completions.logprobs`` are the sampler's log-probs of the drawn tokens under the distribution it drew from
(temperature, top-k, top-p applied and renormalised: vLLM's ``processed_logprobs``); without top-k / top-p they are
the trainer's temperature-scaled log-probs of the same weights. Multi-turn: every call prefills its prompts whole
(turns after the first are re-prefilled; nothing is kept between calls). ZeRO-3: each call gathers the partitioned
weights once (a collective: every rank calls ``generate`` alike) into a copy the engine owns, so decoding needs no
collectives; the copy is a whole model per rank, freed with the KV buffers by ``offload``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from grpo.foundation import dist, lora
from grpo.foundation.config import ConfigError
from grpo.foundation.logprobs import partitioned
from grpo.rollout import delta_net, gemma3n
from grpo.rollout.engine import Completions, EngineSetup, SamplingParams, forced_eos
from grpo.rollout.hf import filter_logits, sample_categorical

# qwen2_vl_text / qwen2_5_vl_text / qwen3_vl_text / qwen3_vl_moe_text: Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and
# Qwen3-VL-MoE's language models, Qwen2's, Qwen3's and Qwen3-MoE's decoders whose multimodal RoPE gives text its
# three position streams equal: the plain RoPE of the same frequencies
# qwen3_5_text / qwen3_5_moe_text / qwen3_next: Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's hybrid decoders (Gated
# DeltaNet layers, see delta_net.py, between gated attention layers with a partial RoPE)
QWEN3_5 = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MODEL_TYPES = ("llama", "mistral", "ministral", "ministral3", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
               "gemma", "gemma2", "gemma3_text", "smollm3", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text",
               "qwen3_vl_moe_text", *QWEN3_5, "gemma4_text", "llama4_text", "mistral4", "gemma3n_text", "olmo2", "olmo3",
               "olmoe", "phi3", "granite")
GEMMA = ("gemma", "gemma2", "gemma3_text")  # RMSNorm x (1 + w) in float32, embeddings scaled by sqrt(hidden)
# norms after attention and around the MLP (OLMo 2 / 3: after them only, no norm before)
SANDWICH = ("gemma2", "gemma3_text", "gemma4_text", "olmo2", "olmo3")
QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_vl_text", "qwen3_vl_moe_text", *QWEN3_5, "gemma4_text",
           "gemma3n_text")
MOE_CHUNK = 1024  # tokens per batched expert GEMM at prefill (its [experts, tokens, 2 x intermediate] is transient)
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
    sandwich: bool = False  # Gemma 2/3: post_attention_layernorm on the attention's output, pre/post norms on the MLP
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
    granite: Optional[tuple[float, float, float]] = None
    qk_norm_full: bool = False  # OLMo 2 / 3, OLMoE: q and k RMS-normed over the whole projection, before the heads split


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
    if kind not in SANDWICH and getattr(cfg, "attn_logit_softcapping", None):
        return (f"attn_logit_softcapping={cfg.attn_logit_softcapping} on a {kind} model: the static engine caps "
                f"Gemma 2/3's attention only")
    if getattr(cfg, "use_bidirectional_attention", None) not in (None, False, "vision"):  # Gemma 4: images only
        return "use_bidirectional_attention: the static engine decodes causally"
    if getattr(outer, "quantization_config", None) or getattr(cfg, "quantization_config", None):
        return "quantized weights: the static engine multiplies by the weights as they are stored"
    return None


def text_config(model: torch.nn.Module):
    """The decoder's config: the model's own, or its text model's in a checkpoint that wraps one with a vision
    tower (Gemma 3 4B-27B: ``Gemma3ForConditionalGeneration``; Mistral Small 3.1 / 3.2 and Magistral:
    ``Mistral3ForConditionalGeneration``), whose text-only forward is its text model's."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "model_type", None) not in MODEL_TYPES and hasattr(cfg, "get_text_config"):
        text = cfg.get_text_config()
        if text is not cfg and hasattr(getattr(model, "model", None), "language_model"):
            return text
    return cfg


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
    heads, kind = cfg.num_attention_heads, cfg.model_type
    first = cfg.per_layer_config[0] if kind == "gemma4_text" else cfg  # Gemma 4: sizes per layer (gemma4_fields)
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
        head_dim=head_dim, eps=cfg.rms_norm_eps, windows=windows, qk_norm=kind in QK_NORM, act=activation(cfg),
        scale=(cfg.query_pre_attn_scalar if kind in ("gemma2", "gemma3_text") else head_dim) ** -0.5,
        gemma_norm=kind in GEMMA + QWEN3_5,  # Qwen3.5's norms are (1 + w) too
        sandwich=kind in SANDWICH, attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
        rope_of_layer=tuple(rope_types.index(t) for t in layer_types) if rope_types else None,
        experts_per_token=getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "top_k_experts", 0) or 0,
        renorm_topk=(kind in ("mixtral", "qwen3_vl_moe_text", "qwen3_5_moe_text")
                     or bool(getattr(cfg, "norm_topk_prob", False))),
        fp32_routing=kind == "mixtral",
        rope_layers=tuple(bool(x) for x in cfg.no_rope_layers) if kind in ("smollm3", "llama4_text") else None,
        q_scale=((cfg.rope_parameters["llama_4_scaling_beta"], cfg.rope_parameters["original_max_position_embeddings"])
                 if kind in ("ministral3", "mistral4") else None),
        attn_gate=kind in QWEN3_5,
        linear=tuple(t == "linear_attention" for t in layer_types) if kind in QWEN3_5 else None,
        delta=delta_net.delta_spec(cfg) if kind in QWEN3_5 else None,
    )
    if kind == "gemma4_text":
        fields.update(gemma4_fields(cfg))
    elif kind == "llama4_text":
        fields.update(llama4_fields(cfg))
    elif kind == "mistral4":
        fields.update(mistral4_fields(cfg, _decoder(model)))
    elif kind in ("olmo2", "olmo3"):
        fields.update(norm_f32="rsqrt", qk_norm_full=True)
    elif kind == "olmoe":
        fields.update(qk_norm_full=True)
    elif kind == "granite":
        fields.update(scale=float(cfg.attention_multiplier), granite=(
            float(cfg.embedding_multiplier), float(cfg.residual_multiplier), float(cfg.logits_scaling)))
    elif kind == "gemma3n_text":
        fields.update(gemma3n_fields(cfg, next(model.parameters()).dtype))
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


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, gemma: bool = False,
             f32: str = "") -> torch.Tensor:
    """RMSNorm in float32 times ``weight``: cast first (Llama's), or ``1 + weight`` in float32 (``gemma``: Gemma 1-3,
    Qwen3.5), or ``weight`` in float32 with the inverse RMS by ``f32`` = "pow" (Gemma 3n and 4, whose value norms have
    no weight) or "rsqrt" (OLMo 2 and 3)."""
    h = x.float()
    if f32 == "pow":
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return (h if weight is None else h * weight.float()).to(x.dtype)
    if f32:  # OLMo: the weight times the float32 normed input, in their promoted dtype
        return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:  # Llama 4's L2 norm of queries and keys
        return h.to(x.dtype)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def moe_mlp(spec: ModelSpec, lw: dict[str, Optional[torch.Tensor]], h: torch.Tensor,
            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A mixture-of-experts MLP as transformers' (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over the router's logits
    in float32, the top-k experts (renormalised or not), each expert's gated MLP scaled by its weight, summed in the
    model's dtype in increasing expert order (transformers' ``index_add_`` order), plus Qwen2-MoE's shared expert
    under a sigmoid gate. Every expert runs on every token in one batched GEMM ([E, tokens, 2 I]): static shapes, no
    host sync, each expert's weights read once per step; only the chosen experts' outputs are kept."""
    x = h.reshape(-1, h.shape[-1])
    logits = F.linear(x, lw["router"])
    if spec.grouped_routing is not None:
        top, idx = grouped_topk(spec, logits)
    else:
        top, idx = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(spec.experts_per_token, dim=-1)
        if spec.renorm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        if not spec.fp32_routing:
            top = top.to(logits.dtype)
    out = experts(x, top, idx, lw["experts_gate_up"], lw["experts_down"], act)
    if lw["shared_gate"] is not None:  # under a sigmoid gate (Qwen2-MoE's), or not (Mistral 4's)
        shared = F.linear(act(F.linear(x, lw["shared_gate"])) * F.linear(x, lw["shared_up"]), lw["shared_down"])
        gate = lw["shared_expert_gate"]
        out = out + (shared if gate is None else torch.sigmoid(F.linear(x, gate)) * shared)
    return out.view(h.shape)


def grouped_topk(spec: ModelSpec, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mistral 4's routing (DeepSeek's): softmax in the model's dtype; the experts split in groups, each group
    scored by its two best, the top ``topk_group`` groups kept; the top-k experts among them, renormalised (or
    not), times ``routed_scaling_factor``."""
    groups, keep, factor = spec.grouped_routing
    scores = logits.softmax(-1)
    E = scores.shape[-1]
    best = scores.view(-1, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.zeros_like(best).scatter_(1, best.topk(keep, dim=-1, sorted=False)[1], 1).bool()
    allowed = chosen[:, :, None].expand(-1, groups, E // groups).reshape(-1, E)
    idx = scores.masked_fill(~allowed, 0.0).topk(spec.experts_per_token, dim=-1, sorted=False)[1]
    top = scores.gather(1, idx)
    if spec.renorm_topk:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * factor, idx


def experts(x: torch.Tensor, top: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The chosen experts (``idx`` [n, k], weights ``top``) of tokens ``x`` [n, H]: each expert's gated MLP
    (``gate_up`` [E, 2 I, H], ``down`` [E, H, I]) scaled by its weight, summed in the model's dtype in increasing
    expert order (transformers' ``index_add_`` order), every expert on every token in one batched GEMM."""
    idx, order = idx.sort(dim=-1)  # increasing expert ids, as transformers adds the experts' outputs
    top = top.gather(-1, order)
    parts = []
    for s in range(0, x.shape[0], MOE_CHUNK):
        xs = x[s: s + MOE_CHUNK]
        gate, up = torch.matmul(xs, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, n, I] each
        y = torch.matmul(act(gate) * up, down.transpose(1, 2))  # [E, n, H]
        chosen = y.transpose(0, 1).gather(1, idx[s: s + MOE_CHUNK, :, None].expand(-1, -1, y.shape[-1]))  # [n, k, H]
        scaled = (chosen * top[s: s + MOE_CHUNK, :, None]).to(x.dtype)
        out = scaled[:, 0]
        for j in range(1, scaled.shape[1]):
            out = out + scaled[:, j]
        parts.append(out)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def llama4_moe(spec: ModelSpec, lw: dict[str, Optional[torch.Tensor]], h: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Llama 4's mixture of experts: the top-k of the router's logits through a sigmoid (in float32, cast back) scale
    each chosen expert's *input*; every expert runs on every token (a zero input gives a zero output), their outputs
    summed, plus the shared expert's."""
    x = h.reshape(-1, h.shape[-1])
    logits = F.linear(x, lw["l4_router"])
    top, idx = logits.topk(spec.experts_per_token, dim=-1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, idx, top).float().sigmoid().to(logits.dtype)
    xs = x[None] * scores.t()[:, :, None]  # [E, n, H]
    gate, up = torch.bmm(xs, lw["experts_gate_up"]).chunk(2, dim=-1)
    routed = torch.bmm(up * act(gate), lw["experts_down"]).sum(dim=0)
    shared = F.linear(act(F.linear(x, lw["shared_gate"])) * F.linear(x, lw["shared_up"]), lw["shared_down"])
    return (shared + routed).view(h.shape)


def gemma4_moe(spec: ModelSpec, lw: dict[str, Optional[torch.Tensor]], x: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Gemma 4's mixture of experts beside its MLP, on the residual stream ``x``: the router reads it RMS-normed
    (no weight) times its scale and 1 / sqrt(hidden), softmax in float32, top-k renormalised, times each chosen
    expert's own scale; the experts read ``x`` under their own norm."""
    flat = x.reshape(-1, x.shape[-1])
    r = spec.norm(flat, None) * lw["g4_router_scale"] * flat.shape[-1] ** -0.5
    probs = torch.softmax(F.linear(r, lw["g4_router"]), dim=-1, dtype=torch.float32)
    top, idx = probs.topk(spec.experts_per_token, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True) * lw["g4_expert_scale"][idx]
    h = spec.norm(flat, lw["pre_ff_norm_2"])
    return experts(h, top, idx, lw["g4_experts_gate_up"], lw["g4_experts_down"], act).view(x.shape)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     cap: float) -> torch.Tensor:
    """Gemma 2's attention (transformers' eager path): scores scaled, soft-capped (cap * tanh(s / cap)), masked,
    softmax in float32. q [R, H, S, D]; k, v [R, KV, L, D] (each kv head serves H / KV query heads, no copy)."""
    R, H, S, D = q.shape
    KV = k.shape[1]
    s = torch.matmul(q.view(R, KV, H // KV, S, D), k[:, :, None].transpose(-1, -2)).view(R, H, S, -1) * scale
    s = (torch.tanh(s / cap) * cap).masked_fill(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p.view(R, KV, H // KV, S, -1), v[:, :, None]).view(R, H, S, D)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of ``x`` (a partial RoPE, Qwen3.5's: the rest pass through)."""
    if cos.shape[-1] < x.shape[-1]:
        return torch.cat((rotate(x[..., : cos.shape[-1]], cos, sin), x[..., cos.shape[-1]:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama 4's RoPE: each pair (x[2j], x[2j + 1]) a complex number times (cos + i sin) of frequency j, in float32."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


def forward(spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor, col: torch.Tensor,
            k_buf: Sequence[torch.Tensor], v_buf: Sequence[torch.Tensor], kpos: torch.Tensor, length: int,
            last_only: bool = True) -> torch.Tensor:
    """Feed ``ids`` [R, S] at positions ``pos`` [R, S] (-1: left padding) into columns ``col .. col + S - 1``
    (``col``: a one-element long tensor, so a captured graph replays at any column) of the KV buffers, one
    [R, kv_heads, max_len, head_dim] tensor per layer (a list: written in place as a whole, a compiled step
    writes one column; a write through a view of one [layers, ...] tensor made Inductor copy the whole buffer
    for every layer, about 300 ms a step at 8 x 16 x 2048 columns on CPU); attend to the first ``length`` columns (a static bucket >= the
    last written column + 1). A Gated DeltaNet layer's two buffers are its states instead (``new_buffers``).
    Returns float32 logits [R, V] of the last column (``last_only``) or [R, S, V]."""
    R, S = ids.shape
    cols = col + torch.arange(S, device=ids.device)
    kpos.index_copy_(1, cols, pos)
    qpos = pos.clamp(min=0)  # padding queries read whatever their row holds; their outputs are never used
    keys_pos = kpos[:, None, None, :length]  # [R, 1, 1, length]
    attend = (keys_pos >= 0) & (keys_pos <= qpos[:, None, :, None])  # [R, 1, S, length]
    x = F.embedding(ids, w.embed)
    if w.embed_scale is not None:
        x = x * w.embed_scale
    if spec.granite is not None:  # Granite 3: the embeddings times their multiplier
        x = x * spec.granite[0]
    ropes = []  # (cos, sin) [R, 1, S, D] of each RoPE
    for inv_freq, scale in zip(w.ropes, w.rope_scale):
        freqs = qpos[..., None].float() * inv_freq.float()
        if spec.rope_interleaved:  # Llama 4: its complex factors' parts, [R, 1, S, D / 2], in float32
            ropes.append(((freqs.cos() * scale)[:, None], (freqs.sin() * scale)[:, None]))
            continue
        emb = torch.cat((freqs, freqs), dim=-1)
        ropes.append(((emb.cos() * scale).to(x.dtype)[:, None], (emb.sin() * scale).to(x.dtype)[:, None]))

    norm = spec.norm
    act, q_scale = ACTIVATIONS[spec.act], None
    if spec.altup:  # Gemma 3n: its per-layer inputs, the AltUp copies of the embeddings
        per_layer = gemma3n.per_layer_inputs(w.extra, ids, x, spec.layers, spec.per_layer_dim, spec.per_layer_vocab,
                                             norm)
        streams = gemma3n.streams_in(w.extra, spec.altup[0], x)
    elif spec.per_layer_dim:  # Gemma 4's per-layer inputs [R, S, layers, width]: the token's own embedding, plus a
        # projection of the (scaled) embeddings, normed, the two summed and scaled by 1 / sqrt(2)
        embed, embed_scale, proj, proj_norm = w.extra
        per_layer = (F.embedding(ids, embed) * embed_scale).view(R, S, spec.layers, spec.per_layer_dim)
        projected = (F.linear(x, proj) * x.shape[-1] ** -0.5).view(R, S, spec.layers, spec.per_layer_dim)
        per_layer = (norm(projected, proj_norm) + per_layer) * 2.0 ** -0.5
    if spec.q_scale is not None:  # Ministral 3 (transformers' get_llama_4_attn_scale), [R, 1, S, 1]
        beta, n = spec.q_scale
        q_scale = (1 + beta * torch.log(1 + torch.floor(qpos / n)))[:, None, :, None]
    for i, lw in enumerate(w.layers):
        if spec.altup:
            def attend_fn(h: torch.Tensor, lw=lw, i=i) -> torch.Tensor:
                return attention(spec, lw, i, h, ropes, qpos, cols, k_buf[i], v_buf[i], attend, keys_pos, length,
                                 q_scale)
            streams = gemma3n.layer(lw, streams, per_layer[:, :, i], spec.altup[1], spec.altup[2], spec.sparsity[i],
                                    attend_fn, norm, act)
            continue
        h = x if lw["in_norm"] is None else norm(x, lw["in_norm"])  # OLMo 2 / 3: no norm before attention
        if spec.linear is not None and spec.linear[i]:  # Qwen3.5's Gated DeltaNet: k_buf / v_buf hold its states
            o = delta_net.layer(spec.delta, lw, h, pos >= 0, k_buf[i], v_buf[i], spec.eps, act)
        else:
            o = attention(spec, lw, i, h, ropes, qpos, cols, k_buf[i], v_buf[i], attend, keys_pos, length, q_scale)
        if spec.granite is not None:  # Granite 3: each residual branch times its multiplier
            o = o * spec.granite[1]
        if spec.sandwich:  # Gemma 2/3: norm the attention's output, then norm the MLP's input and output
            x = x + norm(o, lw["post_norm"])
            h = x if lw["pre_ff_norm"] is None else norm(x, lw["pre_ff_norm"])
        else:
            x = x + o
            h = norm(x, lw["post_norm"])
        if lw["router"] is not None:
            mlp = moe_mlp(spec, lw, h, act)
        elif lw["l4_router"] is not None:
            mlp = llama4_moe(spec, lw, h, act)
        elif lw["gate_up"] is not None:  # Phi-3 / Phi-4: gate and up from one projection
            gate, up = F.linear(h, lw["gate_up"]).chunk(2, dim=-1)
            mlp = F.linear(up * act(gate), lw["down"])
        else:
            mlp = F.linear(act(F.linear(h, lw["gate"], lw["gate_bias"])) * F.linear(h, lw["up"], lw["up_bias"]),
                           lw["down"], lw["down_bias"])
        if lw["g4_router"] is not None:  # Gemma 4's MoE models: experts beside the MLP, both normed
            mlp = norm(mlp, lw["post_ff_norm_1"]) + norm(gemma4_moe(spec, lw, x, act), lw["post_ff_norm_2"])
        if spec.granite is not None:
            mlp = mlp * spec.granite[1]
        x = x + (norm(mlp, lw["post_ff_norm"]) if spec.sandwich else mlp)
        if spec.per_layer_dim:  # Gemma 4: the layer's per-layer input, gated by the hidden state
            g = act(F.linear(x, lw["ple_gate"])) * per_layer[:, :, i]
            x = x + norm(F.linear(g, lw["ple_proj"]), lw["ple_norm"])
        if lw["layer_scalar"] is not None:
            x = x * lw["layer_scalar"]
    if spec.altup:
        x = gemma3n.streams_out(w.extra, spec.altup[0], streams)
    if last_only:
        x = x[:, -1]
    logits = F.linear(norm(x, w.norm), w.head)
    logits = (logits if spec.granite is None else logits / spec.granite[2]).float()  # Granite 3: divided
    if spec.final_softcap:  # in float32, as the trainer's log-probs (grpo/foundation/logprobs.py) cap them
        logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
    return logits


def attention(spec: ModelSpec, lw: dict[str, Optional[torch.Tensor]], i: int, h: torch.Tensor, ropes: list,
              qpos: torch.Tensor, cols: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, attend: torch.Tensor,
              keys_pos: torch.Tensor, length: int, q_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Layer ``i``'s attention (before the residual): writes its keys and values at ``cols``, attends to the first
    ``length`` columns where ``attend`` (and the layer's window) allow."""
    R, S, _ = h.shape
    H, (KV, D) = spec.heads, (spec.layer_dims[i] if spec.layer_dims else (spec.kv_heads, spec.head_dim))
    cos, sin = ropes[spec.rope_of_layer[i] if spec.rope_of_layer else 0]
    rope = spec.rope_layers is None or spec.rope_layers[i]

    norm = spec.norm

    def positional(x: torch.Tensor) -> torch.Tensor:  # RoPE, then Llama 4's L2 norm of its RoPE layers
        if not rope:
            return x
        x = rotate_interleaved(x, cos, sin) if spec.rope_interleaved else rotate(x, cos, sin)
        return norm(x, None) if spec.qk_l2 else x

    if spec.mla is not None:  # Mistral 4
        q, k, v = latent_qkv(spec, lw, h, cos, sin)
        k_buf.index_copy_(2, cols, k)
        v_buf.index_copy_(2, cols, v)
    else:
        if lw["qkv"] is not None:  # Phi-3 / Phi-4: q, k, v from one projection
            q, k_fused, v_fused = F.linear(h, lw["qkv"]).split([H * D, KV * D, KV * D], dim=-1)
        else:
            q = F.linear(h, lw["q"], lw["q_bias"])
        if spec.qk_norm_full:  # OLMo 2 / 3
            q = norm(q, lw["q_norm"])
        if spec.attn_gate:  # Qwen3.5: per head, the query's D dims then its gate's
            q, gate = q.view(R, S, H, 2 * D).chunk(2, dim=-1)
        q = q.reshape(R, S, H, D)
        q = positional((norm(q, lw["q_norm"]) if spec.qk_norm else q).transpose(1, 2))
    if q_scale is not None:
        q = q * q_scale.to(q.dtype)
    if spec.attn_temperature and not rope:  # Llama 4's NoPE layers, [R, 1, S, 1]
        t_scale, floor = spec.attn_temperature
        q = (q * (torch.log1p(torch.floor((qpos.float() + 1.0) / floor)) * t_scale + 1.0)[:, None, :, None]).to(q.dtype)
    if spec.mla is None and (spec.kv_source is None or spec.kv_source[i] == i):  # else (Gemma 4's KV sharing):
        # the buffers are another layer's, already written at these columns
        k = k_fused if lw["qkv"] is not None else F.linear(h, lw["k"], lw["k_bias"])
        k = (norm(k, lw["k_norm"]) if spec.qk_norm_full else k).view(R, S, KV, D)
        if lw["qkv"] is not None:
            v = v_fused.reshape(R, S, KV, D)
        else:
            v = k if spec.k_eq_v and spec.k_eq_v[i] else F.linear(h, lw["v"], lw["v_bias"]).view(R, S, KV, D)
        k = (norm(k, lw["k_norm"]) if spec.qk_norm else k).transpose(1, 2)
        if spec.v_norm:  # Gemma 4: values RMS-normed, no weight
            v = norm(v, None)
        k_buf.index_copy_(2, cols, positional(k))
        v_buf.index_copy_(2, cols, v.transpose(1, 2))
    mask = attend
    if spec.windows[i] is not None:
        mask = mask & (qpos[:, None, :, None] - keys_pos < spec.windows[i])
    if spec.chunks is not None and spec.chunks[i] is not None:  # Llama 4: keys in the query's chunk
        mask = mask & (keys_pos // spec.chunks[i] == qpos[:, None, :, None] // spec.chunks[i])
    keys, values, scale = k_buf[:, :, :length], v_buf[:, :, :length], spec.scale or D ** -0.5
    if spec.attn_softcap:
        a = capped_attention(q, keys, values, mask, scale, spec.attn_softcap)
    else:
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=H != KV)
    a = a.transpose(1, 2).reshape(R, S, -1)
    if spec.attn_gate:
        a = a * torch.sigmoid(gate.reshape(R, S, H * D))
    return F.linear(a, lw["o"], lw["o_bias"])


def latent_qkv(spec: ModelSpec, lw: dict[str, Optional[torch.Tensor]], h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mistral 4's multi-head latent attention: queries (through their low-rank pair and its norm, when the model
    has one), keys and values expanded from the normed latent, one RoPE key shared by every head; q and k
    [R, H, S, nope + rope], v [R, H, S, v_dim]."""
    R, S, _ = h.shape
    nope, rd, dv = spec.mla
    if lw["q"] is not None:
        q = F.linear(h, lw["q"])
    else:
        q = F.linear(spec.norm(F.linear(h, lw["q_a"], lw["q_a_bias"]), lw["q_a_norm"]), lw["q_b"])
    q_pass, q_rot = q.view(R, S, spec.heads, nope + rd).transpose(1, 2).split([nope, rd], dim=-1)
    latent = F.linear(h, lw["kv_a"], lw["kv_a_bias"])
    k_pass, k_rot = latent.split([latent.shape[-1] - rd, rd], dim=-1)
    k_rot = k_rot.reshape(R, 1, S, rd)
    if spec.mla_interleave:  # DeepSeek's layout: pairs (x[2j], x[2j + 1]) rotated, the results' halves concatenated
        c, s = cos[..., : rd // 2], sin[..., : rd // 2]
        q_rot, k_rot = (torch.cat([x[..., 0::2] * c - x[..., 1::2] * s, x[..., 1::2] * c + x[..., 0::2] * s], dim=-1)
                        for x in (q_rot, k_rot))
    else:
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)
    kv = F.linear(spec.norm(k_pass, lw["kv_a_norm"]), lw["kv_b"]).view(R, S, spec.heads, nope + dv)
    k_nope, v = kv.transpose(1, 2).split([nope, dv], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, spec.heads, -1, -1)], dim=-1)
    return torch.cat([q_pass, q_rot], dim=-1), k, v


# ----------------------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float,
           top_k: int, audit_k: int = 0) -> tuple[torch.Tensor, ...]:
    """(token [R], the sampler's log-prob of it [R]) from float32 logits [R, V] and uniforms ``u`` [R]:
    the hf engine's sampler (``filter_logits``, ``sample_categorical``), no host sync. ``audit_k`` (the audit's
    steps): also the k most likely tokens of the distribution before top-k / top-p, [R, k] log-probs and ids."""
    z = filter_logits(logits, temperature, top_p, top_k)
    tok = sample_categorical(z, u[:, None])
    lp = torch.log_softmax(z, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    if not audit_k:
        return tok, lp
    top = torch.log_softmax(logits.float() / temperature, dim=-1).topk(audit_k, dim=-1)
    return tok, lp, top.values, top.indices


def new_buffers(spec: ModelSpec, rows: int, length: int, dtype: torch.dtype, device) -> tuple[list, list]:
    """Each layer's two buffers: an attention layer's keys and values [rows, kv_heads, length, head_dim] (zeros, not
    empty: masked keys still multiply their values by 0, and 0 * NaN is NaN); a Gated DeltaNet layer's convolution
    window and recurrent state (``delta_net.new_state``); a Gemma 4 layer that shares another's KV, that layer's
    very tensors."""
    ks, vs = [], []
    for i in range(spec.layers):
        if spec.linear is not None and spec.linear[i]:
            k, v = delta_net.new_state(spec.delta, rows, dtype, device)
        elif spec.kv_source is not None and spec.kv_source[i] != i:
            k, v = ks[spec.kv_source[i]], vs[spec.kv_source[i]]
        else:
            kv, d = spec.layer_dims[i] if spec.layer_dims else (spec.kv_heads, spec.head_dim)
            k = torch.zeros((rows, kv, length, d), dtype=dtype, device=device)
            v = torch.zeros((rows, kv, length, spec.mla[2] if spec.mla else d), dtype=dtype, device=device)
        ks.append(k)
        vs.append(v)
    return ks, vs


def columns(spec: ModelSpec, i: int, length: int) -> Optional[slice]:
    """The part of layer ``i``'s buffers (dim 2) that holds a row's first ``length`` columns: those keys, or a Gated
    DeltaNet layer's whole state; None for a layer that shares another's buffers (moved with that layer's)."""
    if spec.kv_source is not None and spec.kv_source[i] != i:
        return None
    return slice(None) if spec.linear is not None and spec.linear[i] else slice(0, length)


def rows_bucket(n: int) -> int:
    """Rows are padded to a power of two up to 64, then to a multiple of 64."""
    return 1 << max(0, (n - 1).bit_length()) if n <= 64 else -(-n // 64) * 64


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ----------------------------------------------------------------------------- the engine


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The warm-up stream of every graph capture on ``device``: one for the process (see ``capture_graph``)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def capture_graph(run: Callable[[], tuple[torch.Tensor, ...]], pool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """A CUDA graph of ``run`` (after one warm-up run on a side stream) and its output tensors, which every
    ``replay()`` overwrites. Its inputs are whatever tensors ``run`` reads: their storage must stay.

    The side stream is one for the process's life (per device): torch keeps a cuBLAS workspace (32 MiB on an
    H200) for each (handle, stream) a GEMM ran on and never frees it, so a new stream per capture leaked 32 MiB
    a capture, 160 MiB a step at 5 length buckets recaptured after every ``offload`` (H200, docs/results.md)."""
    side = side_stream(torch.cuda.current_stream().device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model (under a PeftModel wrapper, its base)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def resolve_mode(mode: str, device: torch.device) -> str:
    """``rollout.static.mode`` on this device (``auto``: graphs on CUDA, eager elsewhere; compile is opt-in: 1.6x
    graphs' tokens/s on an H200, but it compiles once per length bucket, 67 s for 256 new tokens: docs/gpu.md)."""
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    if "graphs" in mode and device.type != "cuda":
        raise ConfigError(f"rollout.static.mode={mode!r} needs CUDA (graphs are CUDA graphs), and the policy is on "
                          f"{device.type}: use 'eager' or 'compile' (or 'auto')")
    return mode


class StaticEngine:
    """``rollout.engine: static``: see the module's docstring."""

    def __init__(self, setup: EngineSetup):
        reason = unsupported_reason(setup.model)
        if reason is not None:
            raise ConfigError(f"rollout.engine='static' cannot run this model: {reason}; use rollout.engine='hf' "
                              f"(or 'auto', which picks hf for it)")
        self.setup, self.model = setup, setup.model
        self.spec = model_spec(_base(self.model))
        self.device = next(self.model.parameters()).device
        cfg = setup.cfg.rollout.static
        self.mode = resolve_mode(cfg.mode, self.device)
        self.check_every, self.length_bucket = cfg.check_every, cfg.length_bucket
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(setup.cfg.train.seed * 1_000_003 + dist.rank())  # the engine's own stream
        self.merged: Optional[dict[str, torch.Tensor]] = None  # LoRA: the merged copy (adapted weights only)
        self.owned: Optional[dict[str, torch.Tensor]] = None  # ZeRO-3: the gathered weights
        self.kv: Optional[tuple[list, list, torch.Tensor]] = None  # k, v per layer, kpos (capacity buffers)
        self.graphs: dict[tuple, tuple] = {}  # (rows, length, sampling) -> (graph, static inputs, outputs)
        self.pool = None
        self.pointers: tuple[int, ...] = ()  # the weights' data_ptrs the graphs were captured with
        self.metrics: dict[str, float] = {}
        self.step, self.logits = self._step, self._logits
        if "compile" in self.mode:  # the forward only: Inductor's Triton backend failed on the sampler's 49k-wide
            # cumsum (a split scan, torch 2.11, H200: docs/results.md); the sampler runs eager (captured by graphs)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one per bucket
            # compile_dynamic: sizes that change become symbolic (dynamic=None), else one compile per bucket
            self.logits = torch.compile(self._logits, dynamic=None if cfg.compile_dynamic else False)

    # -- weights
    def weights(self) -> Weights:
        """The step's tensors, read from the module now (LoRA: the merged copy, made at the first call; ZeRO-3:
        gathered once, collectively, and copied into tensors the engine owns)."""
        if partitioned(self.model):
            import deepspeed

            params = dict(self.model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                named = self._own(params)
        elif lora.has_lora(self.model):
            if self.merged is None:
                self.merged = self._merge()
            named = {**lora.base_state_dict(self.model), **self.merged}
        else:
            named = dict(self.model.named_parameters())
        return read_weights(_base(self.model), self.spec, {k: v.detach() for k, v in named.items()})

    def _own(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``named`` in tensors the engine keeps between calls (their pointers stay: no recapture)."""
        if self.owned is None or any(k not in self.owned or self.owned[k].shape != v.shape for k, v in named.items()):
            self.owned = {k: v.detach().clone() for k, v in named.items()}
        else:
            for k, v in named.items():
                self.owned[k].copy_(v.detach())
        return self.owned

    def _merge(self) -> dict[str, torch.Tensor]:
        """The adapted weights (base + scale * B A, and modules_to_save), copies the engine owns."""
        base = lora.base_state_dict(self.model)
        return {k: v.clone() for k, v in lora.merged_state_dict(self.model).items()
                if k not in base or v.data_ptr() != base[k].data_ptr()}

    def sync_weights(self) -> None:
        """LoRA: refresh the merged copy in place (its pointers stay, so captured graphs stay valid). A plain
        policy is read afresh at every call; a weight whose storage moved is seen by the pointer check."""
        if self.merged is None:
            return
        fresh = self._merge()
        for k, v in fresh.items():
            if k in self.merged and self.merged[k].shape == v.shape:
                self.merged[k].copy_(v)
            else:  # a new adapted weight (e.g. a head untied by a reference sync): a new pointer, a recapture
                self.merged[k] = v
        for k in set(self.merged) - set(fresh):  # now the base's own tensor again
            del self.merged[k]

    def pop_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out

    def offload(self) -> None:
        """Before the training passes (``rollout.static.offload``): free the KV buffers and the graphs' memory,
        rebuilt and captured again at the next call."""
        if self.setup.cfg.rollout.static.offload:
            self.release()

    def release(self) -> None:
        """Drop the KV buffers, the graphs and their pool, and a ZeRO-3 copy of the weights; on CUDA their memory
        goes back to the device too unless ``rollout.static.empty_cache`` is off."""
        self.kv, self.graphs, self.pool, self.owned = None, {}, None, None
        if self.device.type == "cuda" and self.setup.cfg.rollout.static.empty_cache:
            torch.cuda.empty_cache()

    # -- one decode step (compiled and / or captured)
    def _logits(self, flat: list, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kpos: torch.Tensor, length: int, rope_scale: tuple[float, ...]) -> torch.Tensor:
        return forward(self.spec, Weights.unflat(flat, rope_scale, extra_count(self.spec)), tok[:, None], pos[:, None],
                       col, k, v, kpos, length)

    def _step(self, flat: list, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, u: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, kpos: torch.Tensor, length: int, rope_scale: tuple[float, ...],
              sampling: tuple[float, float, int, int]) -> tuple[torch.Tensor, ...]:
        return sample(self.logits(flat, tok, pos, col, k, v, kpos, length, rope_scale), u, *sampling)

    def _run_step(self, w: Weights, tok, pos, col, u, k, v, kpos, length, sampling):
        if "graphs" not in self.mode:
            return self.step(w.flat(), tok, pos, col, u, k, v, kpos, length, w.rope_scale, sampling)
        key = (tok.shape[0], length, sampling)
        if key not in self.graphs:
            self.graphs[key] = self._capture(w, [tok, pos, col, u], k, v, kpos, length, sampling)
        graph, inputs, out = self.graphs[key]
        for dst, src in zip(inputs, (tok, pos, col, u)):
            dst.copy_(src)
        graph.replay()
        return out

    def _capture(self, w: Weights, inputs: list[torch.Tensor], k, v, kpos, length, sampling):
        """A CUDA graph of one step at these shapes. The warm-up run (which compiles, under compile+graphs)
        performs this very step, so its KV writes are the ones the replay makes."""
        inputs = [x.clone() for x in inputs]
        flat = w.flat()

        def run():
            return self.step(flat, *inputs, k, v, kpos, length, w.rope_scale, sampling)

        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every graph
        graph, out = capture_graph(run, self.pool)
        return graph, inputs, out

    # -- buffers
    def _buffers(self, rows: int, length: int, dtype: torch.dtype):
        """KV buffers with room for ``rows`` x ``length`` (grown when short; graphs then hold stale pointers)."""
        if self.kv is not None:
            kpos = self.kv[2]
            if kpos.shape[0] >= rows and kpos.shape[1] >= length and self.kv[0][0].dtype == dtype:
                return self.kv
            rows, length = max(rows, kpos.shape[0]), max(length, kpos.shape[1])
        self.graphs = {}
        self.kv = (*new_buffers(self.spec, rows, length, dtype, self.device),
                   torch.full((rows, length), -1, dtype=torch.long, device=self.device))
        return self.kv

    # -- generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> Completions:
        P, G, T = len(prompts), n, params.max_tokens
        w = self.weights()  # under ZeRO-3 a collective: every rank calls generate alike, with or without prompts
        if not P:
            return Completions.empty()
        dev, s, pad = self.device, self.spec, self.setup.pad_id
        if w.pointers() != self.pointers:  # a weight's storage moved: captured graphs read the old one
            self.graphs, self.pointers = {}, w.pointers()
        R, Lp = P * G, max(len(p) for p in prompts)
        Rb = rows_bucket(R)
        k_all, v_all, kpos_all = self._buffers(Rb, round_up(Lp + T, LENGTH_BUCKET), w.embed.dtype)
        sampling = (params.temperature, params.top_p, params.top_k, params.topk_logprobs)
        K = params.topk_logprobs  # the audit's steps: the top-k of each drawn token's distribution

        # prefill: each prompt once, its KV then copied to its G rows
        ids = torch.full((P, Lp), pad, dtype=torch.long)
        pos = torch.full((P, Lp), -1, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, Lp - len(p):] = torch.tensor(p, dtype=torch.long)
            pos[i, Lp - len(p):] = torch.arange(len(p))
        ids, pos = ids.to(dev), pos.to(dev)
        pk, pv = new_buffers(s, P, Lp, w.embed.dtype, dev)
        pkpos = torch.full((P, Lp), -1, dtype=torch.long, device=dev)
        logits = forward(s, w, ids, pos, torch.zeros(1, dtype=torch.long, device=dev), pk, pv, pkpos, Lp)
        for i in range(s.layers):
            if (c := columns(s, i, Lp)) is None:
                continue
            k_all[i][:R, :, c] = pk[i].repeat_interleave(G, dim=0)
            v_all[i][:R, :, c] = pv[i].repeat_interleave(G, dim=0)
        kpos_all[:Rb] = -1
        kpos_all[:R, :Lp] = pkpos.repeat_interleave(G, dim=0)

        # decode state: bucket row b holds row rows_h[b] (R: a padding row, its results land in a spare row)
        rows_h = list(range(R)) + [R] * (Rb - R)
        rows = torch.tensor(rows_h, device=dev)
        nxt = torch.cat([pos[:, -1].repeat_interleave(G) + 1, pos.new_zeros(Rb - R)])
        logits = torch.cat([logits.repeat_interleave(G, dim=0), logits.new_zeros(Rb - R, logits.shape[-1])])
        out_tok = torch.full((R + 1, T), pad, dtype=torch.long, device=dev)
        out_lp = torch.zeros((R + 1, T), dtype=torch.float32, device=dev)
        out_top = (torch.zeros((R + 1, T, K), dtype=torch.float32, device=dev),
                   torch.zeros((R + 1, T, K), dtype=torch.long, device=dev)) if K else None
        lengths = torch.full((R + 1,), T, dtype=torch.long, device=dev)
        finished = torch.zeros(R + 1, dtype=torch.bool, device=dev)
        finished[R] = True
        eos = None if params.ignore_eos else torch.tensor(sorted(self.setup.eos_ids), dtype=torch.long, device=dev)
        u_all = torch.rand((T, R + 1), generator=self.gen, device=dev)  # row r draws u_all[t, r] at step t
        forced = None if eos is None else forced_eos(params, R, dev)  # benchmarks: EOS at recorded lengths
        flags = torch.empty(R + 1, dtype=torch.bool, pin_memory=dev.type == "cuda")
        event = torch.cuda.Event() if dev.type == "cuda" else None
        pending = False

        cols = torch.arange(Lp, Lp + T, device=dev)
        cap = kpos_all.shape[1]
        k_rows, v_rows = [k[:Rb] for k in k_all], [v[:Rb] for v in v_all]  # each layer's rows of the bucket
        tok, lp, *top = sample(logits, u_all[0, rows], *sampling)
        for t in range(T):
            if t:
                col = Lp + t - 1  # the column of token t - 1, fed now
                length = min(cap, round_up(col + 1, self.length_bucket or cap))
                tok, lp, *top = self._run_step(w, tok, nxt, cols[t - 1: t], u_all[t, rows], k_rows, v_rows,
                                               kpos_all[:Rb], length, sampling)
                nxt = nxt + 1
            if forced is not None:
                tok = torch.where(forced[rows] == t + 1, eos[0], tok)
            out_tok[rows, t] = tok
            out_lp[rows, t] = lp
            if out_top is not None:
                out_top[0][rows, t], out_top[1][rows, t] = top
            if eos is None:
                continue
            now = torch.isin(tok, eos) & ~finished[rows]
            lengths[rows] = torch.where(now, t + 1, lengths[rows])
            finished[rows] = finished[rows] | now
            if pending:  # the flags copied one step ago: waited for only now that this step is queued
                if event is not None:
                    event.synchronize()
                pending = False
                live = [r for r, done in enumerate(flags[:R].tolist()) if not done]
                if not live:
                    break
                if rows_bucket(len(live)) < Rb:  # compaction: the live rows move into a smaller bucket
                    self.metrics["rollout/compactions"] = self.metrics.get("rollout/compactions", 0.0) + 1
                    keep = set(live)
                    sel = [b for b, r in enumerate(rows_h) if r in keep]
                    Rb, rows_h = rows_bucket(len(live)), [rows_h[b] for b in sel]
                    rows_h += [R] * (Rb - len(sel))
                    rows = torch.tensor(rows_h, device=dev)
                    idx, L = torch.tensor(sel, device=dev), Lp + t  # the columns written so far
                    for i in range(s.layers):
                        if (c := columns(s, i, L)) is None:
                            continue
                        k_all[i][: len(sel), :, c] = k_all[i][idx, :, c]
                        v_all[i][: len(sel), :, c] = v_all[i][idx, :, c]
                    k_rows, v_rows = [k[:Rb] for k in k_all], [v[:Rb] for v in v_all]
                    kpos_all[: len(sel), :L] = kpos_all[idx, :L]
                    kpos_all[len(sel): Rb] = -1
                    spare = Rb - len(sel)
                    tok = torch.cat([tok[idx], tok.new_full((spare,), pad)])
                    nxt = torch.cat([nxt[idx], nxt.new_zeros(spare)])
            if (t + 1) % self.check_every == 0:
                flags.copy_(finished, non_blocking=True)
                if event is not None:
                    event.record()
                pending = True

        lengths_l, toks, lps = lengths[:R].tolist(), out_tok[:R].tolist(), out_lp[:R].tolist()
        tokens = [row[:m] for row, m in zip(toks, lengths_l)]
        eos_set = set(self.setup.eos_ids)
        truncated = torch.tensor([not (tk and tk[-1] in eos_set) for tk in tokens], dtype=torch.bool)
        out = Completions(tokens=tokens, truncated=truncated, logprobs=[row[:m] for row, m in zip(lps, lengths_l)])
        if out_top is not None:  # zeros past each row's end
            past = (torch.arange(T, device=dev).unsqueeze(0) >= lengths[:R].unsqueeze(1)).unsqueeze(-1)
            out.topk_logprobs = out_top[0][:R].masked_fill(past, 0.0).cpu()
            out.topk_ids = out_top[1][:R].masked_fill(past, 0).cpu()
        return out
