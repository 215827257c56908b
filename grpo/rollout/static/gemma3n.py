"""Gemma 3n's decoder as a step of the static engine (grpo/rollout/static/): what its layers add around the
attention and MLP the engine already has.

Gemma 3n (transformers' ``Gemma3nTextModel``) carries ``altup_num_inputs`` copies of the hidden state (AltUp: the
first is the token's embedding, the others its projections rescaled to the same RMS). Each layer *predicts* every
copy from all of them (coefficients from a router on the active copy), runs attention and MLP on the active
prediction with a low-rank residual beside them (LAuReL), then *corrects* every copy with the layer's innovation,
and adds the layer's per-layer input to the copies after the first. The first layers' MLPs keep only the gate
activations above a Gaussian quantile (activation sparsity). At the end the copies are projected back, rescaled
and averaged. Every function below is transformers' arithmetic, order and dtypes included; the caller passes the
engine's norm (Gemma 3n's: weights in float32) and attention.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# transformers' names under ``layers.<i>.`` -> the static engine's per-layer keys
LAYER_KEYS = {
    "altup_out_scale": "altup.correct_output_scale", "altup_correct": "altup.correction_coefs.weight",
    "altup_predict": "altup.prediction_coefs.weight", "altup_router": "altup.modality_router.weight",
    "altup_router_norm": "altup.router_norm.weight", "altup_router_scale": "altup.router_input_scale",
    "laurel_left": "laurel.linear_left.weight", "laurel_right": "laurel.linear_right.weight",
    "laurel_norm": "laurel.post_laurel_norm.weight",
}
# the per-layer inputs' gate, projection and norm in each layer (Gemma 3n's and 4's)
PLE_KEYS = {"ple_gate": "per_layer_input_gate.weight", "ple_proj": "per_layer_projection.weight",
            "ple_norm": "post_per_layer_input_norm.weight"}
Norm = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def extra_names(top: str, n: int) -> list[str]:
    """The model-level tensors the step reads after the per-layer inputs' four (``top``: the decoder's prefix; ``n``:
    altup_num_inputs): the per-layer inputs' two scales (buffers), the copies' projections in, then out."""
    return ([f"{top}per_layer_projection_scale", f"{top}per_layer_input_scale"]
            + [f"{top}altup_projections.{i}.weight" for i in range(n - 1)]
            + [f"{top}altup_unembed_projections.{i}.weight" for i in range(n - 1)])


def per_layer_inputs(extra: tuple, ids: torch.Tensor, x: torch.Tensor, layers: int, width: int, vocab: int,
                     norm: Norm) -> torch.Tensor:
    """[R, S, layers, width]: the token's per-layer embedding (ids past its vocabulary read row 0) plus the
    embeddings' projection, normed, times 1 / sqrt(2) (Gemma 3n's buffers, in the embeddings' dtype)."""
    embed, embed_scale, proj, proj_norm, proj_scale, input_scale = extra[:6]
    R, S = ids.shape
    ids = torch.where((ids >= 0) & (ids < vocab), ids, 0)
    own = (F.embedding(ids, embed) * embed_scale.to(embed.dtype)).view(R, S, layers, width)
    projected = (F.linear(x, proj) * proj_scale.to(x.dtype)).view(R, S, layers, width)
    return (norm(projected, proj_norm) + own) * input_scale.to(x.dtype)


def _rescaled(x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    return x * magnitude / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))


def streams_in(extra: tuple, n: int, x: torch.Tensor) -> torch.Tensor:
    """[n, R, S, H]: the embeddings, then their projections rescaled to the embeddings' RMS."""
    magnitude = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([x] + [_rescaled(F.linear(x, extra[6 + i]).to(x.dtype), magnitude) for i in range(n - 1)])


def streams_out(extra: tuple, n: int, streams: torch.Tensor) -> torch.Tensor:
    """The copies projected back (after the first), rescaled to the first's RMS, averaged: [R, S, H]."""
    magnitude = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
    out = [streams[0]] + [_rescaled(F.linear(streams[i], extra[6 + n - 1 + i - 1]).to(streams.dtype), magnitude)
                          for i in range(1, n)]
    return torch.stack(out).mean(dim=0)


def quantile(sparsity: float, dtype: torch.dtype) -> Optional[float]:
    """Phi^-1(sparsity) as transformers computes it (float32, rounded to the model's dtype); None: a dense MLP. A
    constant of the step, computed once on the host (no copy to the device inside a captured graph)."""
    if sparsity <= 0.0:
        return None
    return float(torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32)).to(dtype))


def sparse_gate(gate: torch.Tensor, multiplier: float) -> torch.Tensor:
    """The gate activations above mean + std x ``multiplier`` (``quantile``'s, per token), shifted down by it."""
    cutoff = gate.mean(dim=-1, keepdim=True) + gate.std(dim=-1, keepdim=True, unbiased=False) * multiplier
    return F.relu(gate - cutoff)


def _modalities(lw: dict, x: torch.Tensor, norm: Norm) -> torch.Tensor:
    routed = F.linear(norm(x, lw["altup_router_norm"]) * lw["altup_router_scale"], lw["altup_router"])
    return torch.tanh(routed.float()).type_as(x)


def layer(lw: dict, streams: torch.Tensor, per_layer: torch.Tensor, active: int, correct_scale: bool,
          sparsity: Optional[float], attention: Callable[[torch.Tensor], torch.Tensor], norm: Norm,
          act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One Gemma 3n decoder layer on the copies ``streams`` [n, R, S, H]; ``attention(h)``: the layer's attention
    of its normed input (the engine's, keys and values written or shared); ``sparsity``: its MLP's ``quantile``."""
    n = streams.shape[0]
    modalities = _modalities(lw, streams[active], norm)  # predict
    coefs = F.linear(modalities, lw["altup_predict"]).reshape(*modalities.shape[:-1], n, n).permute(0, 1, 3, 2)
    predictions = (torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2) + streams).type_as(streams)
    x = predictions[active]
    h = norm(x, lw["in_norm"])
    laurel = h + norm(F.linear(F.linear(h, lw["laurel_left"]), lw["laurel_right"]), lw["laurel_norm"])
    attended = ((x + norm(attention(h), lw["post_norm"])) + laurel) / math.sqrt(2)
    h = norm(attended, lw["pre_ff_norm"])
    gate = F.linear(h, lw["gate"])
    if sparsity is not None:
        gate = sparse_gate(gate, sparsity)
    out = attended + norm(F.linear(act(gate) * F.linear(h, lw["up"]), lw["down"]), lw["post_ff_norm"])
    modalities = _modalities(lw, out, norm)  # correct
    coefs = (F.linear(modalities, lw["altup_correct"]) + 1.0).permute(2, 0, 1).unsqueeze(-1)
    corrected = ((out - predictions[active]).unsqueeze(0) * coefs + predictions).type_as(out)
    first = corrected[active]
    if correct_scale:
        first = (first.type_as(lw["altup_out_scale"]) * lw["altup_out_scale"]).type_as(first)
    first = norm(F.linear(act(F.linear(first, lw["ple_gate"])) * per_layer, lw["ple_proj"]), lw["ple_norm"])
    return torch.cat([corrected[:1], corrected[1:] + first])


def block(spec, lw: dict, i: int, streams: torch.Tensor, mix: Callable[[torch.Tensor], torch.Tensor],
          act: Callable[[torch.Tensor], torch.Tensor], per_layer: torch.Tensor) -> torch.Tensor:
    """Gemma 3n's entry in the table of families (blocks.py's signature): :func:`layer` on the AltUp copies."""
    return layer(lw, streams, per_layer, spec.altup[1], spec.altup[2], spec.sparsity[i], mix, spec.norm, act)
