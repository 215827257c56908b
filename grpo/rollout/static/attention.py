"""The attention of the static step. A family names how its layers make their queries, keys and values in the
table of families (spec.py): ``Family.project``, the projections (``separate``: q, k, v each its own, with their
biases; ``fused``: Phi-3's one q|k|v projection), and ``Family.qkv``, what becomes of them (``heads``: per-head norms,
the output gate, RoPE, as most families; ``latent``: Mistral 4's multi-head latent attention). ``attention`` is the
rest, every family's: the keys and values written into the layer's KV buffers, the query scales, the window and
chunk masks, the scores (soft-capped for Gemma 2), the gate and the output projection.

Each ``qkv(spec, lw, i, h, cos, sin, own_kv) -> (q, k, v, gate)``: q [R, H, S, D]; k, v [R, KV, S, D] as they enter
the buffers (RoPE applied), None when the layer reads another layer's (``own_kv`` False: Gemma 3n's and 4's KV
sharing); gate [R, S, H * D] or None.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

Layer = dict[str, Optional[torch.Tensor]]

# Phi-3 / Phi-4: q, k and v from one projection
FUSED_QKV_KEYS = {"qkv": "self_attn.qkv_proj.weight"}
# Mistral 4's latent attention: the query's low-rank pair and its norm, the latent's projection, norm and expansion
LATENT_KEYS = {
    "q_a": "self_attn.q_a_proj.weight", "q_a_bias": "self_attn.q_a_proj.bias",
    "q_a_norm": "self_attn.q_a_layernorm.weight", "q_b": "self_attn.q_b_proj.weight",
    "kv_a": "self_attn.kv_a_proj_with_mqa.weight", "kv_a_bias": "self_attn.kv_a_proj_with_mqa.bias",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b": "self_attn.kv_b_proj.weight",
}


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


# ----------------------------------------------------------------------------- projections (Family.project)


def separate(spec: Any, lw: Layer, i: int, h: torch.Tensor,
             own_kv: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """q, k, v [R, S, width] each from its own projection, with its bias when the model has one; k and v None without
    ``own_kv``, v None where it is the key (Gemma 4's ``attention_k_eq_v`` layers)."""
    q = F.linear(h, lw["q"], lw["q_bias"])
    if not own_kv:
        return q, None, None
    k = F.linear(h, lw["k"], lw["k_bias"])
    v = None if spec.k_eq_v and spec.k_eq_v[i] else F.linear(h, lw["v"], lw["v_bias"])
    return q, k, v


def fused(spec: Any, lw: Layer, i: int, h: torch.Tensor,
          own_kv: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Phi-3 / Phi-4: q, k and v split from one projection."""
    H, KV, D = spec.heads, spec.kv_heads, spec.head_dim
    return tuple(F.linear(h, lw["qkv"]).split([H * D, KV * D, KV * D], dim=-1))


# ----------------------------------------------------------------------------- queries, keys, values (Family.qkv)


def heads(spec: Any, lw: Layer, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, own_kv: bool):
    """Most families': the family's projections (``spec.project``), OLMo's norms over the whole projection, Qwen3.5's
    output gate (per head, the query's D dims then its gate's), the per-head q/k norms, RoPE on the layer's RoPE
    (and Llama 4's L2 norm after it), Gemma's value norm."""
    R, S, _ = h.shape
    H, (KV, D) = spec.heads, (spec.layer_dims[i] if spec.layer_dims else (spec.kv_heads, spec.head_dim))
    norm = spec.norm
    rope = spec.rope_on(i)

    def positional(x: torch.Tensor) -> torch.Tensor:  # RoPE, then Llama 4's L2 norm of its RoPE layers
        if not rope:
            return x
        x = rotate_interleaved(x, cos, sin) if spec.rope_interleaved else rotate(x, cos, sin)
        return norm(x, None) if spec.qk_l2 else x

    q, k, v = spec.project(spec, lw, i, h, own_kv)
    gate = None
    if spec.qk_norm_full:  # OLMo 2 / 3
        q = norm(q, lw["q_norm"])
    if spec.attn_gate:  # Qwen3.5
        q, gate = q.view(R, S, H, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(R, S, H * D)
    q = q.reshape(R, S, H, D)
    q = positional((norm(q, lw["q_norm"]) if spec.qk_norm else q).transpose(1, 2))
    if k is None:  # the buffers are another layer's, already written at these columns
        return q, None, None, gate
    k = (norm(k, lw["k_norm"]) if spec.qk_norm_full else k).view(R, S, KV, D)
    v = k if v is None else v.reshape(R, S, KV, D)
    k = (norm(k, lw["k_norm"]) if spec.qk_norm else k).transpose(1, 2)
    if spec.v_norm:  # Gemma 3n / 4: values RMS-normed, no weight
        v = norm(v, None)
    return q, positional(k), v.transpose(1, 2), gate


def latent(spec: Any, lw: Layer, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, own_kv: bool):
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
    latent_kv = F.linear(h, lw["kv_a"], lw["kv_a_bias"])
    k_pass, k_rot = latent_kv.split([latent_kv.shape[-1] - rd, rd], dim=-1)
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
    return torch.cat([q_pass, q_rot], dim=-1), k, v, None


# ----------------------------------------------------------------------------- the layer's attention


def attention(spec: Any, lw: Layer, i: int, h: torch.Tensor, ropes: list, qpos: torch.Tensor, cols: torch.Tensor,
              k_buf: torch.Tensor, v_buf: torch.Tensor, attend: torch.Tensor, keys_pos: torch.Tensor, length: int,
              q_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Layer ``i``'s attention (before the residual): writes its keys and values at ``cols``, attends to the first
    ``length`` columns where ``attend`` (and the layer's window or chunk) allow."""
    R, S, _ = h.shape
    cos, sin = ropes[spec.rope_of_layer[i] if spec.rope_of_layer else 0]
    q, k, v, gate = spec.qkv(spec, lw, i, h, cos, sin, spec.kv_source is None or spec.kv_source[i] == i)
    if k is not None:
        k_buf.index_copy_(2, cols, k)
        v_buf.index_copy_(2, cols, v)
    if q_scale is not None:
        q = q * q_scale.to(q.dtype)
    if spec.attn_temperature and not spec.rope_on(i):  # Llama 4's NoPE layers
        t_scale, floor = spec.attn_temperature
        q = (q * (torch.log1p(torch.floor((qpos.float() + 1.0) / floor)) * t_scale + 1.0)[:, None, :, None]).to(q.dtype)
    mask = attend
    if spec.windows[i] is not None:
        mask = mask & (qpos[:, None, :, None] - keys_pos < spec.windows[i])
    if spec.chunks is not None and spec.chunks[i] is not None:  # Llama 4: keys in the query's chunk
        mask = mask & (keys_pos // spec.chunks[i] == qpos[:, None, :, None] // spec.chunks[i])
    keys, values, scale = k_buf[:, :, :length], v_buf[:, :, :length], spec.scale or q.shape[-1] ** -0.5
    if spec.attn_softcap:
        a = capped_attention(q, keys, values, mask, scale, spec.attn_softcap)
    else:
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != keys.shape[1])
    a = a.transpose(1, 2).reshape(R, S, -1)
    if gate is not None:
        a = a * torch.sigmoid(gate)
    return F.linear(a, lw["o"], lw["o_bias"])
