"""The MLPs of the static step, one function per kind, each ``mlp(spec, lw, h, x, act)``: ``h`` the layer's normed
input, ``x`` its residual stream (Gemma 4's experts read it), ``lw`` the layer's weights, ``act`` the gate's
activation. A family names its MLP in the table of families (spec.py: ``Family.mlp``) with the layer weights it
reads (``*_KEYS``: the static engine's key -> transformers' name under ``layers.<i>.``). A layer of a
mixture-of-experts family without a router is dense (Qwen2-MoE's ``mlp_only_layers``, Llama 4's interleaved and
Mistral 4's first dense layers)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

MOE_CHUNK = 1024  # tokens per batched expert GEMM at prefill (its [experts, tokens, 2 x intermediate] is transient)
Layer = dict[str, Optional[torch.Tensor]]
Act = Callable[[torch.Tensor], torch.Tensor]

# the gated MLP (every family's dense layers)
DENSE_KEYS = {
    "gate": "mlp.gate_proj.weight", "gate_bias": "mlp.gate_proj.bias",
    "up": "mlp.up_proj.weight", "up_bias": "mlp.up_proj.bias",
    "down": "mlp.down_proj.weight", "down_bias": "mlp.down_proj.bias",
}
# Phi-3 / Phi-4: gate and up from one projection
FUSED_KEYS = {"gate_up": "mlp.gate_up_proj.weight"}
# mixture of experts: the router, the experts' [E, 2 I, H] gate-and-up and [E, H, I] down weights, Qwen2-MoE's
# shared expert and its gate
MOE_KEYS = {
    "router": "mlp.gate.weight", "experts_gate_up": "mlp.experts.gate_up_proj", "experts_down": "mlp.experts.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj.weight", "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight", "shared_expert_gate": "mlp.shared_expert_gate.weight",
}
# Llama 4's router (its experts: experts_gate_up [E, H, 2 I] and experts_down [E, I, H], transposed against the
# others'; its MLP is ``feed_forward``, renamed ``mlp`` as it is read)
LLAMA4_KEYS = {"l4_router": "mlp.router.weight", **{k: v for k, v in MOE_KEYS.items() if k.startswith(("experts",
                                                                                                         "shared_"))}}
# Gemma 4's mixture of experts beside the MLP: its router, experts and norms
GEMMA4_KEYS = {
    "g4_router": "router.proj.weight", "g4_router_scale": "router.scale", "g4_expert_scale": "router.per_expert_scale",
    "g4_experts_gate_up": "experts.gate_up_proj", "g4_experts_down": "experts.down_proj",
    "pre_ff_norm_2": "pre_feedforward_layernorm_2.weight", "post_ff_norm_1": "post_feedforward_layernorm_1.weight",
    "post_ff_norm_2": "post_feedforward_layernorm_2.weight",
}


def gated(spec: Any, lw: Layer, h: torch.Tensor, x: torch.Tensor, act: Act) -> torch.Tensor:
    """down(act(gate(h)) * up(h)), each projection with its bias when the model has one."""
    return F.linear(act(F.linear(h, lw["gate"], lw["gate_bias"])) * F.linear(h, lw["up"], lw["up_bias"]),
                    lw["down"], lw["down_bias"])


def fused(spec: Any, lw: Layer, h: torch.Tensor, x: torch.Tensor, act: Act) -> torch.Tensor:
    """Phi-3 / Phi-4's gated MLP: gate and up from one projection."""
    gate, up = F.linear(h, lw["gate_up"]).chunk(2, dim=-1)
    return F.linear(up * act(gate), lw["down"])


def moe(spec: Any, lw: Layer, h: torch.Tensor, x: torch.Tensor, act: Act) -> torch.Tensor:
    """A mixture-of-experts MLP as transformers' (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over the router's logits
    in float32, the top-k experts (renormalised or not), each expert's gated MLP scaled by its weight, summed in the
    model's dtype in increasing expert order (transformers' ``index_add_`` order), plus Qwen2-MoE's shared expert
    under a sigmoid gate. Every expert runs on every token in one batched GEMM ([E, tokens, 2 I]): static shapes, no
    host sync, each expert's weights read once per step; only the chosen experts' outputs are kept."""
    if lw["router"] is None:
        return gated(spec, lw, h, x, act)
    flat = h.reshape(-1, h.shape[-1])
    logits = F.linear(flat, lw["router"])
    if spec.grouped_routing is not None:
        top, idx = grouped_topk(spec, logits)
    else:
        top, idx = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(spec.experts_per_token, dim=-1)
        if spec.renorm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        if not spec.fp32_routing:
            top = top.to(logits.dtype)
    out = experts(flat, top, idx, lw["experts_gate_up"], lw["experts_down"], act)
    if lw["shared_gate"] is not None:  # under a sigmoid gate (Qwen2-MoE's), or not (Mistral 4's)
        shared = F.linear(act(F.linear(flat, lw["shared_gate"])) * F.linear(flat, lw["shared_up"]), lw["shared_down"])
        gate = lw["shared_expert_gate"]
        out = out + (shared if gate is None else torch.sigmoid(F.linear(flat, gate)) * shared)
    return out.view(h.shape)


def grouped_topk(spec: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
            act: Act) -> torch.Tensor:
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


def llama4(spec: Any, lw: Layer, h: torch.Tensor, x: torch.Tensor, act: Act) -> torch.Tensor:
    """Llama 4's mixture of experts: the top-k of the router's logits through a sigmoid (in float32, cast back) scale
    each chosen expert's *input*; every expert runs on every token (a zero input gives a zero output), their outputs
    summed, plus the shared expert's."""
    if lw["l4_router"] is None:
        return gated(spec, lw, h, x, act)
    flat = h.reshape(-1, h.shape[-1])
    logits = F.linear(flat, lw["l4_router"])
    top, idx = logits.topk(spec.experts_per_token, dim=-1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, idx, top).float().sigmoid().to(logits.dtype)
    xs = flat[None] * scores.t()[:, :, None]  # [E, n, H]
    gate, up = torch.bmm(xs, lw["experts_gate_up"]).chunk(2, dim=-1)
    routed = torch.bmm(up * act(gate), lw["experts_down"]).sum(dim=0)
    shared = F.linear(act(F.linear(flat, lw["shared_gate"])) * F.linear(flat, lw["shared_up"]), lw["shared_down"])
    return (shared + routed).view(h.shape)


def gemma4(spec: Any, lw: Layer, h: torch.Tensor, x: torch.Tensor, act: Act) -> torch.Tensor:
    """Gemma 4's MLP, and in its MoE models the experts beside it, each normed: the router reads the residual
    stream ``x`` RMS-normed (no weight) times its scale and 1 / sqrt(hidden), softmax in float32, top-k
    renormalised, times each chosen expert's own scale; the experts read ``x`` under their own norm."""
    out = gated(spec, lw, h, x, act)
    if lw["g4_router"] is None:
        return out
    flat = x.reshape(-1, x.shape[-1])
    r = spec.norm(flat, None) * lw["g4_router_scale"] * flat.shape[-1] ** -0.5
    probs = torch.softmax(F.linear(r, lw["g4_router"]), dim=-1, dtype=torch.float32)
    top, idx = probs.topk(spec.experts_per_token, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True) * lw["g4_expert_scale"][idx]
    routed = experts(spec.norm(flat, lw["pre_ff_norm_2"]), top, idx, lw["g4_experts_gate_up"], lw["g4_experts_down"],
                     act).view(x.shape)
    return spec.norm(out, lw["post_ff_norm_1"]) + spec.norm(routed, lw["post_ff_norm_2"])
