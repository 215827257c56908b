"""The static step: ``forward``, one functional pass (prefill or decode) over static KV buffers, each layer's
shape, attention and MLP its family's (blocks.py, attention.py, mlp.py); ``sample``: the sampler, without a host
sync."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from grpo.rollout.hf import filter_logits, sample_categorical
from grpo.rollout.static import delta_net, gemma3n
from grpo.rollout.static.attention import attention
from grpo.rollout.static.spec import ACTIVATIONS, ModelSpec
from grpo.rollout.static.weights import Weights


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
    act, q_scale, per_layer = ACTIVATIONS[spec.act], None, None
    if spec.altup:  # Gemma 3n: its per-layer inputs; the residual stream is the AltUp copies of the embeddings
        per_layer = gemma3n.per_layer_inputs(w.extra, ids, x, spec.layers, spec.per_layer_dim, spec.per_layer_vocab,
                                             norm)
        x = gemma3n.streams_in(w.extra, spec.altup[0], x)
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
        def mix(h: torch.Tensor, lw=lw, i=i) -> torch.Tensor:  # the layer's token mixer on its normed input
            if spec.linear is not None and spec.linear[i]:  # Qwen3.5's Gated DeltaNet: k_buf / v_buf hold its states
                return delta_net.layer(spec.delta, lw, h, pos >= 0, k_buf[i], v_buf[i], spec.eps, act)
            return attention(spec, lw, i, h, ropes, qpos, cols, k_buf[i], v_buf[i], attend, keys_pos, length, q_scale)

        x = spec.block(spec, lw, i, x, mix, act, None if per_layer is None else per_layer[:, :, i])  # the family's
    if spec.altup:
        x = gemma3n.streams_out(w.extra, spec.altup[0], x)
    if last_only:
        x = x[:, -1]
    logits = F.linear(norm(x, w.norm), w.head)
    logits = (logits if spec.logit_scale == 1.0 else logits * spec.logit_scale).float()  # Granite 3: 1 / its scaling
    if spec.final_softcap:  # in float32, as the trainer's log-probs (grpo/foundation/logprobs.py) cap them
        logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
    return logits


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
