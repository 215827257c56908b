"""The decoder layer's shape in the static step, one function per kind, each ``block(spec, lw, i, x, mix, act,
per_layer)``: layer ``i``'s residual stream ``x`` in, out; ``mix(h)``: the layer's token mixer on its normed input
(attention, or a Gated DeltaNet layer), ``act`` the MLP's activation, ``per_layer`` the layer's per-layer input
(Gemma 4's; None without). A family names its block in the table of families (spec.py: ``Family.block``): ``pre_norm``
(Llama's, most families'), ``sandwich`` (Gemma 2-4, OLMo 2/3: norms after the attention and around the MLP), or
Gemma 3n's (gemma3n.py: ``block``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

Layer = dict[str, Optional[torch.Tensor]]
Mix = Callable[[torch.Tensor], torch.Tensor]


def pre_norm(spec: Any, lw: Layer, i: int, x: torch.Tensor, mix: Mix, act: Callable,
             per_layer: Optional[torch.Tensor]) -> torch.Tensor:
    """x + mix(norm(x)), then + mlp(norm(x)); Granite 3 multiplies each branch by its residual multiplier."""
    norm = spec.norm
    o = mix(x if lw["in_norm"] is None else norm(x, lw["in_norm"]))
    if spec.granite is not None:
        o = o * spec.granite[1]
    x = x + o
    m = spec.mlp(spec, lw, norm(x, lw["post_norm"]), x, act)  # the family's (mlp.py)
    if spec.granite is not None:
        m = m * spec.granite[1]
    return x + m


def sandwich(spec: Any, lw: Layer, i: int, x: torch.Tensor, mix: Mix, act: Callable,
             per_layer: Optional[torch.Tensor]) -> torch.Tensor:
    """Gemma 2-4's layer: the attention's output normed, the MLP's input and output normed (OLMo 2 / 3 have no norms
    before them: the output norms only); Gemma 4's per-layer input gated by the hidden state, and its layer scalar."""
    norm = spec.norm
    x = x + norm(mix(x if lw["in_norm"] is None else norm(x, lw["in_norm"])), lw["post_norm"])
    h = x if lw["pre_ff_norm"] is None else norm(x, lw["pre_ff_norm"])
    x = x + norm(spec.mlp(spec, lw, h, x, act), lw["post_ff_norm"])
    if per_layer is not None:  # Gemma 4
        g = act(F.linear(x, lw["ple_gate"])) * per_layer
        x = x + norm(F.linear(g, lw["ple_proj"]), lw["ple_norm"])
    if lw.get("layer_scalar") is not None:  # Gemma 4
        x = x * lw["layer_scalar"]
    return x
