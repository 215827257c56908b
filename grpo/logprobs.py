"""Per-token log-probs (and entropy) of completion tokens, computed lean.

The LM head runs only on completion positions, chunk by chunk; under autograd each chunk
is checkpointed, so neither the forward nor the backward pass ever holds a
[tokens x vocab] float32 tensor for more than one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class Packed:
    """Right-padded sequences ``prompt + completion``; row i's completion starts at ``start[i]``."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    start: torch.Tensor  # [B] index of the first completion token
    length: torch.Tensor  # [B] completion tokens that count (mask sum)
    width: int  # columns of the returned [B, width] tensors


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int, width: Optional[int] = None) -> Packed:
    """Concatenate each prompt with its completion, right-pad to the longest row only."""
    rows = [p + c for p, c in zip(prompts, completions)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        att[i, : len(r)] = 1
    start = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    length = torch.tensor([len(c) for c in completions], dtype=torch.long)
    w = int(length.max()) if width is None else width
    return Packed(ids, att, start, length, max(w, 1))


def _head_logits(head: torch.nn.Module, hidden: torch.Tensor, temperature: float, softcap: Optional[float]) -> torch.Tensor:
    logits = head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):  # reduce in float32 at least
        logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature


def _chunk_logprob(head, hidden, targets, temperature, softcap):
    logits = _head_logits(head, hidden, temperature, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse


def _chunk_logprob_entropy(head, hidden, targets, temperature, softcap):
    logits = _head_logits(head, hidden, temperature, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return lp, entropy


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(head(h)/T)[target] for [n, H] hidden states, chunk by chunk; entropy is detached."""
    fn = _chunk_logprob_entropy if with_entropy else _chunk_logprob
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[s : s + chunk_size], targets[s : s + chunk_size]
        if use_ckpt:
            out = checkpoint(fn, head, h, y, temperature, softcap, use_reentrant=False)
        else:
            out = fn(head, h, y, temperature, softcap)
        if with_entropy:
            lps.append(out[0])
            ents.append(out[1])
        else:
            lps.append(out)
    lp = torch.cat(lps) if lps else hidden.new_zeros(0)
    ent = (torch.cat(ents) if ents else hidden.new_zeros(0)) if with_entropy else None
    return lp, ent


def completion_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[B, width] log-probs of each row's completion tokens (0 beyond its length), and entropy."""
    device = next(model.parameters()).device
    ids = packed.input_ids.to(device)
    hidden = model.base_model(input_ids=ids, attention_mask=packed.attention_mask.to(device)).last_hidden_state
    B, width = ids.shape[0], packed.width
    cols = torch.arange(width, device=device)
    valid = cols.unsqueeze(0) < packed.length.to(device).unsqueeze(1)  # [B, width]
    rows, tcols = valid.nonzero(as_tuple=True)
    pos = packed.start.to(device)[rows] + tcols  # position of the completion token
    h = hidden[rows, pos - 1]
    targets = ids[rows, pos]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    lp, ent = head_logprobs(model.get_output_embeddings(), h, targets, temperature, chunk_size, with_entropy, softcap)
    out = torch.zeros(B, width, dtype=lp.dtype, device=device)
    out = out.index_put((rows, tcols), lp)
    ent_out = None
    if ent is not None:
        ent_out = torch.zeros(B, width, dtype=ent.dtype, device=device).index_put((rows, tcols), ent)
    return out, ent_out
