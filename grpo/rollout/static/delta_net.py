"""Qwen3.5's and Qwen3-Next's Gated DeltaNet layers (linear attention) as a step of the static engine
(grpo/rollout/static/).

A linear-attention layer keeps no keys and values. Per row it keeps two buffers, updated in place so that a decode
step keeps static shapes and a CUDA graph replays it: the last ``kernel`` inputs of its causal convolution (the
model's dtype) and its recurrent state [v_heads, k_dim, v_dim] (float32, as transformers keeps it). The arithmetic
is transformers' own (``Qwen3_5GatedDeltaNet``, Qwen3.5 and Qwen3.5-MoE alike; ``Qwen3NextGatedDeltaNet`` fuses the
projections into two whose outputs are grouped per key head, ungrouped here as there): the q/k/v projection through a
depthwise causal convolution and SiLU, q and k L2-normalised, the gated delta rule with decay
``-exp(A_log) softplus(a + dt_bias)`` and step ``sigmoid(b)`` (the rule is transformers' function: chunked over a
prompt, one token at a time while decoding, as its ``generate``), an RMSNorm gated by SiLU(z), the output
projection. Left padding: the layer's input is zeroed at padding positions (as transformers masks a padded
prefill), so the convolution reads zeros and the state stays zero until a row's first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# transformers' names of a linear-attention layer's tensors (under ``layers.<i>.``), keys of the static engine's
# per-layer weights
LAYER_KEYS = {
    "lin_qkv": "linear_attn.in_proj_qkv.weight", "lin_z": "linear_attn.in_proj_z.weight",
    "lin_b": "linear_attn.in_proj_b.weight", "lin_a": "linear_attn.in_proj_a.weight",
    "lin_conv": "linear_attn.conv1d.weight", "lin_conv_bias": "linear_attn.conv1d.bias",
    "lin_dt_bias": "linear_attn.dt_bias", "lin_A_log": "linear_attn.A_log", "lin_norm": "linear_attn.norm.weight",
    "lin_out": "linear_attn.out_proj.weight",
    "lin_qkvz": "linear_attn.in_proj_qkvz.weight", "lin_ba": "linear_attn.in_proj_ba.weight",  # Qwen3-Next's
}


@dataclass(frozen=True)
class DeltaSpec:
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int  # the convolution's width

    @property
    def channels(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


def delta_spec(cfg) -> DeltaSpec:
    return DeltaSpec(k_heads=cfg.linear_num_key_heads, v_heads=cfg.linear_num_value_heads,
                     k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim,
                     kernel=cfg.linear_conv_kernel_dim)


def new_state(d: DeltaSpec, rows: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the convolution's window [rows, channels, kernel] in ``dtype``, the recurrent state [rows, v_heads, k_dim,
    v_dim] in float32), zero: a row before its first token."""
    return (torch.zeros((rows, d.channels, d.kernel), dtype=dtype, device=device),
            torch.zeros((rows, d.v_heads, d.k_dim, d.v_dim), dtype=torch.float32, device=device))


def _rules() -> tuple[Callable, Callable]:
    """transformers' gated delta rule: (chunked, for a prompt; recurrent, for one token)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim, then times SiLU(gate) in float32 (transformers' ``RMSNormGated``)."""
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def projections(d: DeltaSpec, lw: dict[str, Optional[torch.Tensor]], h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q|k|v [R, S, channels], z [R, S, v_heads, v_dim], b and a [R, S, v_heads]) of ``h`` [R, S, hidden]: Qwen3.5's
    four projections, or Qwen3-Next's two, whose outputs come per key head (its q, k, its value heads' v and z; its
    value heads' b and a)."""
    R, S, _ = h.shape
    if lw["lin_qkvz"] is None:
        return (F.linear(h, lw["lin_qkv"]), F.linear(h, lw["lin_z"]).reshape(R, S, d.v_heads, d.v_dim),
                F.linear(h, lw["lin_b"]), F.linear(h, lw["lin_a"]))
    n = d.v_heads // d.k_heads  # value heads per key head
    qkvz = F.linear(h, lw["lin_qkvz"]).view(R, S, d.k_heads, 2 * d.k_dim + 2 * n * d.v_dim)
    q, k, v, z = qkvz.split([d.k_dim, d.k_dim, n * d.v_dim, n * d.v_dim], dim=3)
    b, a = F.linear(h, lw["lin_ba"]).view(R, S, d.k_heads, 2 * n).split([n, n], dim=3)
    return (torch.cat([q.reshape(R, S, -1), k.reshape(R, S, -1), v.reshape(R, S, -1)], dim=-1),
            z.reshape(R, S, d.v_heads, d.v_dim), b.reshape(R, S, d.v_heads), a.reshape(R, S, d.v_heads))


def layer(d: DeltaSpec, lw: dict[str, Optional[torch.Tensor]], h: torch.Tensor, valid: torch.Tensor,
          conv: torch.Tensor, state: torch.Tensor, eps: float,
          act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The layer's output for inputs ``h`` [R, S, hidden] (already normed; ``valid`` [R, S]: not padding), reading
    and updating ``conv`` and ``state`` (``new_state``'s) in place."""
    R, S, _ = h.shape
    h = h * valid[..., None].to(h.dtype)
    x, z, b, a = projections(d, lw, h)
    x = x.transpose(1, 2)  # [R, channels, S]
    window = torch.cat([conv, x], dim=-1).to(lw["lin_conv"].dtype)
    conv.copy_(window[..., -d.kernel:])
    x = act(F.conv1d(window, lw["lin_conv"], lw["lin_conv_bias"], groups=d.channels)[..., -S:]).to(h.dtype)
    q, k, v = x.transpose(1, 2).split([d.k_heads * d.k_dim, d.k_heads * d.k_dim, d.v_heads * d.v_dim], dim=-1)
    beta = b.sigmoid()
    g = -lw["lin_A_log"].float().exp() * F.softplus(a.float() + lw["lin_dt_bias"])
    chunked, recurrent = _rules()
    q, k = (x.reshape(R, S, d.k_heads, d.k_dim) for x in (q, k))
    if d.v_heads != d.k_heads:  # each key head serves v_heads / k_heads consecutive value heads: repeated here, as
        # transformers' layer did up to 5.17 (its rules then wanted equal heads; 5.24's repeat them themselves)
        q, k = (x.repeat_interleave(d.v_heads // d.k_heads, dim=2) for x in (q, k))
    out, last = (recurrent if S == 1 else chunked)(
        q, k, v.reshape(R, S, d.v_heads, d.v_dim), g=g, beta=beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    state.copy_(last)
    return F.linear(gated_rms_norm(out, z, lw["lin_norm"], eps).reshape(R, S, -1), lw["lin_out"])
