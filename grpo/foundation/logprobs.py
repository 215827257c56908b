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

from grpo.foundation import dist


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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precisions and float32, float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LinearHeadLogprob(torch.autograd.Function):
    """log softmax(softcap(h W^T + b) / T)[target] for a linear LM head, chunk by chunk.

    The forward keeps only the log-normaliser of each row (one float per token); the backward
    recomputes a chunk's logits into one buffer and turns it in place into the gradient
    d lp / d logits = onehot(target) - softmax, so at most one [chunk x vocab] float32 tensor
    exists at a time, forward or backward. Same values and gradients as autograd through the
    naive expression (tests/test_logprobs.py), with fewer passes over the logits than
    checkpointing the naive chunk (no second log-sum-exp, no scatter into a zero tensor).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk_size, with_entropy):
        n, acc = hidden.shape[0], _acc_dtype(weight.dtype)
        lp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = _LinearHeadLogprob._logits(hidden[s:e], weight, bias, temperature, softcap)[0]
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            lp[s:e] = logits.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1) - lse[s:e]
            if ent is not None:  # H = lse - sum_v p_v z_v
                z = logits
                ent[s:e] = lse[s:e] - (torch.exp(z - lse[s:e].unsqueeze(-1)) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.softcap, ctx.chunk_size = temperature, softcap, chunk_size
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def _logits(h, weight, bias, temperature, softcap):
        """(float32 logits / T, tanh of the capped ones or None)."""
        logits = torch.nn.functional.linear(h, weight, bias).to(_acc_dtype(weight.dtype))
        th = None
        if softcap:
            th = torch.tanh(logits / softcap)
            logits = th * softcap
        if temperature != 1.0:
            logits = logits / temperature
        return logits, th

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        T, cap, chunk = ctx.temperature, ctx.softcap, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc_dtype(weight.dtype)  # weight gradients summed over chunks in at least float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        grad_lp = grad_lp.to(acc)
        for s in range(0, hidden.shape[0], chunk):
            e = min(hidden.shape[0], s + chunk)
            logits, th = _LinearHeadLogprob._logits(hidden[s:e], weight, bias, T, cap)
            g = grad_lp[s:e]
            # d lp / d logits = onehot - softmax, times the incoming gradient, in place
            dz = logits.sub_(lse[s:e].unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
            dz.scatter_add_(-1, targets[s:e].unsqueeze(-1), g.unsqueeze(-1))
            if T != 1.0:
                dz.div_(T)
            if th is not None:  # d (c tanh(x / c)) / dx = 1 - tanh^2
                dz.mul_(1.0 - th * th)
            dz = dz.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = dz @ weight
            if grad_w is not None:
                if weight.dtype == acc:
                    grad_w.addmm_(dz.t(), hidden[s:e])
                else:  # half-precision product, float32 sum
                    grad_w += dz.t() @ hidden[s:e]
            if grad_b is not None:
                grad_b += dz.sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _plain_linear(head: torch.nn.Module) -> bool:
    """A bare nn.Linear whose weight is all here (not a ZeRO-3 partition gathered by module hooks)."""
    return type(head) is torch.nn.Linear and not hasattr(head.weight, "ds_id")


def _partitioned_linear(head: torch.nn.Module) -> bool:
    """A bare nn.Linear whose weight is a ZeRO-3 partition."""
    return type(head) is torch.nn.Linear and hasattr(head.weight, "ds_id")


def partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weights are ZeRO-3 partitions, gathered (collectively, when there are several
    ranks) inside every call: every rank must then make the same sequence of calls."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _collective_max(n: int) -> int:
    return int(dist.all_reduce_max(torch.tensor([float(n)], dtype=torch.float64))[0])


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = False,
    softcap: Optional[float] = None,
    fused: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(head(h)/T)[target] for [n, H] hidden states, chunk by chunk; entropy is detached.

    A plain linear head takes the fused path (:class:`_LinearHeadLogprob`); any other head (or
    ``fused=False``) runs the naive chunk under activation checkpointing.
    """
    if fused and _plain_linear(head):
        lp, ent = _LinearHeadLogprob.apply(hidden, head.weight, head.bias, targets, temperature, softcap,
                                           chunk_size, with_entropy)
        return lp, ent
    if fused and _partitioned_linear(head) and not torch.is_grad_enabled():
        # ZeRO-3 without gradients (old log-probs, the reference): gather the head once, then the fused
        # path. One collective per call, however many chunks: ranks with unequal token counts stay in step.
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in (head.weight, head.bias) if p is not None]):
            return _LinearHeadLogprob.apply(hidden, head.weight, head.bias, targets, temperature, softcap,
                                            chunk_size, with_entropy)
    fn = _chunk_logprob_entropy if with_entropy else _chunk_logprob
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    starts = list(range(0, hidden.shape[0], chunk_size))
    if partitioned(head):
        # ZeRO-3: the head's weight is gathered in each chunk's call (and again in its backward). A rank with
        # fewer completion tokens runs empty chunks so that every rank makes as many calls as the busiest
        # one; their (empty) outputs join the result, so their backward passes run too.
        starts += [hidden.shape[0]] * (_collective_max(len(starts)) - len(starts))
    lps, ents = [], []
    for s in starts:
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


def _prompt_groups(packed: Packed) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of the rows (first-seen order) and each row's prompt index."""
    ids, start = packed.input_ids.tolist(), packed.start.tolist()
    seen: dict[tuple, int] = {}
    which = [seen.setdefault(tuple(r[:s]), len(seen)) for r, s in zip(ids, start)]
    return [list(p) for p in seen], which


def _can_share_prefix(model: torch.nn.Module) -> bool:
    """A cache-capable decoder run without activation checkpointing (which turns the cache off)."""
    ckpt = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5 (the old name warns)
    if ckpt is None:
        ckpt = getattr(model, "is_gradient_checkpointing", False)
    return bool(getattr(model.config, "use_cache", True)) and not ckpt


def _shared_prefix_hidden(model: torch.nn.Module, packed: Packed, prompts: list[list[int]], which: list[int],
                          device) -> torch.Tensor:
    """[B, width, H]: column t holds the hidden state that predicts completion token t.

    Each distinct prompt runs once (right-padded: no query row is fully masked); its keys and values, with their
    autograd history, are repeated for the rows that share it, and the completions run on top of
    them. The same numbers as one forward over every ``prompt + completion`` row, without running
    a group's prompt G times forward and backward.
    """
    from transformers import DynamicCache

    U, Lp = len(prompts), max(len(p) for p in prompts)
    p_ids = torch.zeros((U, Lp), dtype=torch.long)  # right padding, masked: any id will do
    p_att = torch.zeros((U, Lp), dtype=torch.long)
    for i, p in enumerate(prompts):
        p_ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        p_att[i, : len(p)] = 1
    p_ids, p_att = p_ids.to(device), p_att.to(device)
    p_len = p_att.sum(-1)
    out = model.base_model(input_ids=p_ids, attention_mask=p_att, past_key_values=DynamicCache(), use_cache=True)
    cache = out.past_key_values
    h_last = out.last_hidden_state[torch.arange(U, device=device), p_len - 1]  # predicts completion token 0
    idx = torch.tensor(which, dtype=torch.long, device=device)
    cache.batch_select_indices(idx)  # differentiable: the rows' gradients add up in the shared prompt
    B, width = packed.input_ids.shape[0], packed.width
    start, length = packed.start.to(device), packed.length.to(device)
    if width > 1:
        cols = torch.arange(width - 1, device=device)
        c_pos = start.unsqueeze(1) + cols.unsqueeze(0)  # [B, width - 1] absolute positions
        c_att = (cols.unsqueeze(0) < length.unsqueeze(1) - 1).long()
        full_ids = packed.input_ids.to(device)
        c_ids = full_ids.gather(1, c_pos.clamp(max=full_ids.shape[1] - 1))
        att = torch.cat([p_att[idx], c_att], dim=1)
        h_c = model.base_model(input_ids=c_ids, attention_mask=att, position_ids=c_pos, past_key_values=cache,
                               use_cache=True).last_hidden_state
        return torch.cat([h_last[idx].unsqueeze(1), h_c], dim=1)
    return h_last[idx].unsqueeze(1)


def completion_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = False,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[B, width] log-probs of each row's completion tokens (0 beyond its length), and entropy.

    Rows that share a prompt (a group) run it once (``share_prefix``; see
    :func:`_shared_prefix_hidden`); the LM head runs on completion positions only.
    """
    device = next(model.parameters()).device
    ids = packed.input_ids.to(device)
    B, width = ids.shape[0], packed.width
    cols = torch.arange(width, device=device)
    valid = cols.unsqueeze(0) < packed.length.to(device).unsqueeze(1)  # [B, width]
    rows, tcols = valid.nonzero(as_tuple=True)
    pos = packed.start.to(device)[rows] + tcols  # position of the completion token
    targets = ids[rows, pos]
    prompts, which = _prompt_groups(packed) if share_prefix and B > 1 else ([], [])
    share = bool(prompts) and len(prompts) < B and _can_share_prefix(model)
    if partitioned(model):  # ZeRO-3: one forward pass or two (prompts, then completions) on every rank alike
        share = not dist.any_rank(not (share and width > 1))
    if share:
        h = _shared_prefix_hidden(model, packed, prompts, which, device)[rows, tcols]
    else:
        hidden = model.base_model(input_ids=ids, attention_mask=packed.attention_mask.to(device)).last_hidden_state
        h = hidden[rows, pos - 1]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    lp, ent = head_logprobs(model.get_output_embeddings(), h, targets, temperature, chunk_size, with_entropy, softcap)
    out = torch.zeros(B, width, dtype=lp.dtype, device=device)
    out = out.index_put((rows, tcols), lp)
    ent_out = None
    if ent is not None:
        ent_out = torch.zeros(B, width, dtype=ent.dtype, device=device).index_put((rows, tcols), ent)
    return out, ent_out
