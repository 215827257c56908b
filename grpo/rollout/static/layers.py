"""The layer math of the static step: RoPE, attention (soft-capped, latent), and ``forward``: one functional pass
(prefill or decode) over static KV buffers, each layer's MLP its family's (mlp.py); ``sample``: the sampler,
without a host sync."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from grpo.rollout.hf import filter_logits, sample_categorical
from grpo.rollout.static import delta_net, gemma3n
from grpo.rollout.static.spec import ACTIVATIONS, ModelSpec
from grpo.rollout.static.weights import Weights


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
        mlp = spec.mlp(spec, lw, h, x, act)  # the family's (mlp.py)
        if spec.granite is not None:
            mlp = mlp * spec.granite[1]
        x = x + (norm(mlp, lw["post_ff_norm"]) if spec.sandwich else mlp)
        if spec.per_layer_dim:  # Gemma 4: the layer's per-layer input, gated by the hidden state
            g = act(F.linear(x, lw["ple_gate"])) * per_layer[:, :, i]
            x = x + norm(F.linear(g, lw["ple_proj"]), lw["ple_norm"])
        if lw.get("layer_scalar") is not None:  # Gemma 4
            x = x * lw["layer_scalar"]
    if spec.altup:
        x = gemma3n.streams_out(w.extra, spec.altup[0], streams)
    if last_only:
        x = x[:, -1]
    logits = F.linear(norm(x, w.norm), w.head)
    logits = (logits if spec.logit_scale == 1.0 else logits * spec.logit_scale).float()  # Granite 3: 1 / its scaling
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
        fused = lw.get("qkv")
        if fused is not None:  # Phi-3 / Phi-4: q, k, v from one projection
            q, k_fused, v_fused = F.linear(h, fused).split([H * D, KV * D, KV * D], dim=-1)
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
        k = k_fused if fused is not None else F.linear(h, lw["k"], lw["k_bias"])
        k = (norm(k, lw["k_norm"]) if spec.qk_norm_full else k).view(R, S, KV, D)
        if fused is not None:
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
