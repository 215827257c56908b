"""Per-token log-probs (and entropy) of completion tokens, computed lean.

The LM head runs only on completion positions, chunk by chunk; under autograd each chunk
is checkpointed, so neither the forward nor the backward pass ever holds a
[tokens x vocab] float32 tensor for more than one chunk. The entropy is detached unless
``entropy_grad`` (an entropy bonus in the loss: ``algo.entropy_coef``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from grpo.foundation import dist
from grpo.foundation.families import logit_scale, text_config


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


def _gather(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits[i, targets[i]] for [n] targets ([n]), or logits[i, targets[i, j]] for [n, m] targets ([n, m])."""
    if targets.dim() == 2:
        return logits.gather(-1, targets)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _per_row(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row [n] value ``x`` shaped to broadcast against ``like`` ([n] or [n, m])."""
    return x.unsqueeze(-1) if like.dim() == 2 else x


def _chunk_logprob(head, hidden, targets, temperature, softcap):
    logits = _head_logits(head, hidden, temperature, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    return _gather(logits, targets) - _per_row(lse, targets)


def _chunk_logprob_entropy(head, hidden, targets, temperature, softcap, entropy_grad=False, sum_pi_squared=False):
    """(log-probs, entropy, sum_v pi_v^2 or None); the last is detached, the entropy too unless ``entropy_grad``."""
    logits = _head_logits(head, hidden, temperature, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    lp = _gather(logits, targets) - _per_row(lse, targets)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    sq = None
    if sum_pi_squared:
        with torch.no_grad():
            sq = _sum_pi_squared(logits, lse)
    return lp, entropy, sq


def _sum_pi_squared(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """sum_v pi_v^2 = exp(logsumexp(2 z) - 2 logsumexp(z)), per row."""
    return torch.exp(torch.logsumexp(2 * logits, dim=-1) - 2 * lse)


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
    With ``entropy_grad`` the entropy H = -sum_v p_v log p_v is differentiable too:
    d H / d z_v = -p_v (log p_v + H), added in the same buffer (one more per chunk).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk_size, with_entropy,
                entropy_grad=False, sum_pi_squared=False):
        n, acc = hidden.shape[0], _acc_dtype(weight.dtype)
        lp = torch.empty(targets.shape, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
        sq = torch.empty(n, dtype=acc, device=hidden.device) if sum_pi_squared else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = _LinearHeadLogprob._logits(hidden[s:e], weight, bias, temperature, softcap)[0]
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            lp[s:e] = _gather(logits, targets[s:e]) - _per_row(lse[s:e], targets[s:e])
            if ent is not None:  # H = lse - sum_v p_v z_v
                z = logits
                ent[s:e] = lse[s:e] - (torch.exp(z - lse[s:e].unsqueeze(-1)) * z).sum(-1)
            if sq is not None:
                sq[s:e] = _sum_pi_squared(logits, lse[s:e])
        entropy_grad = entropy_grad and ent is not None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent if entropy_grad else None)
        ctx.temperature, ctx.softcap, ctx.chunk_size = temperature, softcap, chunk_size
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        if sq is not None:
            ctx.mark_non_differentiable(sq)
        return lp, ent, sq

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
    def backward(ctx, grad_lp, grad_ent, grad_sq):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        T, cap, chunk = ctx.temperature, ctx.softcap, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc_dtype(weight.dtype)  # weight gradients summed over chunks in at least float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        grad_lp = torch.zeros(targets.shape, dtype=acc, device=lse.device) if grad_lp is None else grad_lp.to(acc)
        cols = targets if targets.dim() == 2 else targets.unsqueeze(-1)  # [n, m] targets: m log-probs per row
        grad_ent = grad_ent.to(acc) if (grad_ent is not None and ent is not None) else None
        for s in range(0, hidden.shape[0], chunk):
            e = min(hidden.shape[0], s + chunk)
            logits, th = _LinearHeadLogprob._logits(hidden[s:e], weight, bias, T, cap)
            g = grad_lp[s:e].reshape(e - s, -1)  # [chunk, m]
            g_all = g.sum(-1)  # d lp_j / d z = onehot(target_j) - softmax: the softmax's share adds up over j
            logp = logits.sub_(lse[s:e].unsqueeze(-1))  # log softmax, in place
            if grad_ent is None:  # d lp / d logits = onehot - softmax, times the incoming gradient, in place
                dz = logp.exp_().mul_(-g_all.unsqueeze(-1))
            else:  # + d H / d logits = -p (log p + H), times its incoming gradient
                p = logp.exp()
                dz = logp.add_(ent[s:e].unsqueeze(-1)).mul_(grad_ent[s:e].unsqueeze(-1)).add_(g_all.unsqueeze(-1))
                dz.mul_(p).neg_()
                del p
            dz.scatter_add_(-1, cols[s:e], g)
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
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


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


def device_chunk_size(chunk_size: int, device: torch.device) -> int:
    """``train.logprob_chunk_size``, where 0 means by device: 256 tokens on a CPU (small buffers, nothing to
    fill), 512 on a GPU: on an H200 at the 1.7B shape 512 trained no slower than 2048 and its peak was about
    0.5 GiB lower (100 MB of fp32 logits a chunk at a 49k vocabulary, against 400 MB; docs/results.md)."""
    return chunk_size or (512 if torch.device(device).type == "cuda" else 256)


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 0,
    with_entropy: bool = False,
    softcap: Optional[float] = None,
    fused: bool = True,
    entropy_grad: bool = False,
    sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """log softmax(head(h)/T)[target] for [n, H] hidden states and [n] targets (or [n, m] targets: [n, m] log-probs,
    each with its gradient), chunk by chunk; the entropy (``with_entropy``)
    is detached unless ``entropy_grad``. Returns (log-probs, entropy or None), and a third tensor with
    ``sum_pi_squared``: sum_v pi_v^2 per token, detached (verl's optimal token baseline).

    A plain linear head takes the fused path (:class:`_LinearHeadLogprob`); any other head (or
    ``fused=False``) runs the naive chunk under activation checkpointing. ``chunk_size`` 0: by device
    (:func:`device_chunk_size`).
    """
    chunk_size = device_chunk_size(chunk_size, hidden.device)
    with_entropy = with_entropy or entropy_grad
    if fused and _plain_linear(head):
        out = _LinearHeadLogprob.apply(hidden, head.weight, head.bias, targets, temperature, softcap,
                                       chunk_size, with_entropy, entropy_grad, sum_pi_squared)
        return out if sum_pi_squared else out[:2]
    if fused and _partitioned_linear(head) and not torch.is_grad_enabled():
        # ZeRO-3 without gradients (old log-probs, the reference): gather the head once, then the fused
        # path. One collective per call, however many chunks: ranks with unequal token counts stay in step.
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in (head.weight, head.bias) if p is not None]):
            out = _LinearHeadLogprob.apply(hidden, head.weight, head.bias, targets, temperature, softcap,
                                           chunk_size, with_entropy, False, sum_pi_squared)
            return out if sum_pi_squared else out[:2]
    want_entropy, with_entropy = with_entropy, with_entropy or sum_pi_squared
    if with_entropy:
        def fn(*a):
            return _chunk_logprob_entropy(*a, entropy_grad=entropy_grad, sum_pi_squared=sum_pi_squared)
    else:
        fn = _chunk_logprob
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    starts = list(range(0, hidden.shape[0], chunk_size))
    if partitioned(head):
        # ZeRO-3: the head's weight is gathered in each chunk's call (and again in its backward). A rank with
        # fewer completion tokens runs empty chunks so that every rank makes as many calls as the busiest
        # one; their (empty) outputs join the result, so their backward passes run too.
        starts += [hidden.shape[0]] * (_collective_max(len(starts)) - len(starts))
    lps, ents, sqs = [], [], []
    for s in starts:
        h, y = hidden[s : s + chunk_size], targets[s : s + chunk_size]
        if use_ckpt:
            out = checkpoint(fn, head, h, y, temperature, softcap, use_reentrant=False)
        else:
            out = fn(head, h, y, temperature, softcap)
        if with_entropy:
            lps.append(out[0])
            ents.append(out[1])
            sqs.append(out[2])
        else:
            lps.append(out)
    lp = torch.cat(lps) if lps else hidden.new_zeros(0)
    ent = (torch.cat(ents) if ents else hidden.new_zeros(0)) if with_entropy else None
    if sum_pi_squared:
        return lp, (ent if want_entropy else None), (torch.cat(sqs) if sqs else hidden.new_zeros(0))
    return lp, ent


@torch.no_grad()
def head_topk(head: torch.nn.Module, hidden: torch.Tensor, k: int, temperature: float = 1.0, chunk_size: int = 0,
              softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens after each of [n, H] hidden states: (log-probs [n, k] float32 or float64, ids
    [n, k]), most likely first; one [chunk x vocab] logits tensor at a time. A ZeRO-3 head is gathered once."""
    chunk_size = device_chunk_size(chunk_size, hidden.device)
    n = hidden.shape[0]
    if type(head) is torch.nn.Linear:
        def logits_of(h):
            return _LinearHeadLogprob._logits(h, head.weight, head.bias, temperature, softcap)[0]
    else:
        def logits_of(h):
            return _head_logits(head, h, temperature, softcap)
    starts = list(range(0, n, chunk_size))
    if partitioned(head) and type(head) is not torch.nn.Linear:  # gathered in each call: as many calls per rank
        starts += [n] * (_collective_max(len(starts)) - len(starts))
    gather = contextlib.nullcontext()
    if _partitioned_linear(head):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([p for p in (head.weight, head.bias) if p is not None])
    vals, idx = [], []
    with gather:
        for s in starts:
            logits = logits_of(hidden[s : s + chunk_size])
            top = logits.topk(min(k, logits.shape[-1]), dim=-1)
            vals.append(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
            idx.append(top.indices)
    if not vals:
        return hidden.new_zeros((0, k), dtype=torch.float32), torch.zeros((0, k), dtype=torch.long, device=hidden.device)
    return torch.cat(vals), torch.cat(idx)


def _prompt_groups(packed: Packed) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of the rows (first-seen order) and each row's prompt index."""
    ids, start = packed.input_ids.tolist(), packed.start.tolist()
    seen: dict[tuple, int] = {}
    which = [seen.setdefault(tuple(r[:s]), len(seen)) for r, s in zip(ids, start)]
    return [list(p) for p in seen], which


# how far the probe's log-probs may sit from the model's own forward before the head is called not reproduced: float32
# rounding, or bf16 / fp16 logits (about 0.2 nats at a logit of 40); a missed scale or cap moves them by nats
PROBE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
HALF_PROBE_TOLERANCE = 1.0


@torch.no_grad()
def check_head(model: torch.nn.Module) -> float:
    """The log-probs here on a short probe against the model's own forward: the most they differ, in nats. Raises
    a ConfigError past the dtype's tolerance: its causal-LM forward transforms the head's logits in a way this
    module does not reproduce (``logit_scale``, the final soft-cap), and every log-prob, ratio, KL and entropy of
    the run would be another distribution's. Not on ZeRO-3 partitions (their forward is collective)."""
    from grpo.foundation.config import ConfigError

    head = model.get_output_embeddings()
    device, vocab = next(model.parameters()).device, head.weight.shape[0]
    ids = (vocab // 2 + torch.arange(6)) % vocab  # mid-vocabulary tokens: no special or image tokens
    was_training = model.training
    model.eval()
    try:
        own = torch.log_softmax(model(input_ids=ids[None].to(device)).logits[0, 2:-1].double(), -1)
        own = own.gather(-1, ids[3:, None].to(device))[:, 0]
        ours = completion_scores(model, pack([ids[:3].tolist()], [ids[3:].tolist()], 0), 1.0).logprobs[0, :3]
    finally:
        model.train(was_training)
    gap = float((own - ours.double()).abs().max())
    dtype = next(model.parameters()).dtype
    if gap > PROBE_TOLERANCE.get(dtype, HALF_PROBE_TOLERANCE):
        raise ConfigError(
            f"model {text_config(model).model_type!r}: the trainer's log-probs differ from the model's own forward by "
            f"{gap:.3g} nats on a probe: its causal-LM forward transforms the head's logits in a way the trainer "
            f"does not reproduce (grpo/foundation/families.py: HEADS); training it would follow another "
            f"distribution. Please report the model.")
    return gap


def _decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder under the head (transformers' ``base_model``; Llama 4's text model names the multimodal
    checkpoint's attribute as its base, so its ``base_model`` is the whole model: its decoder is ``model.model``)."""
    base = model.base_model
    return model.model if base is model and hasattr(model, "model") else base


def _can_share_prefix(model: torch.nn.Module, length: int) -> bool:
    """A cache-capable decoder run without activation checkpointing (which turns the cache off), and no sliding
    window shorter than ``length`` tokens: transformers applies the window to cache columns, and the shared path
    leaves padding columns between a prompt and its completion (the window would then cover the wrong keys). Not
    with gradients through ZeRO-3 leaf modules (mixture-of-experts blocks, ``mark_moe_leaves``): DeepSpeed reduces a
    leaf's gradients in its backward hook, which fires once per call, so a block called for the prompt and again
    for the completions would have its gradients reduced twice. Not with recurrent layers (Qwen3.5's linear
    attention: ``has_recurrent_layers``). Not when Llama 4's attention chunks or its NoPE layers' query scale change
    within ``length`` positions: transformers reads both from cache columns, not positions."""
    ckpt = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5 (the old name warns)
    if ckpt is None:
        ckpt = getattr(model, "is_gradient_checkpointing", False)
    text = text_config(model)
    window = getattr(text, "sliding_window", None)  # a multimodal checkpoint's (Gemma 3 4B-27B) is its text model's
    if torch.is_grad_enabled() and any(getattr(m, "_z3_leaf", False) for m in model.modules()):
        return False
    from grpo.foundation.modeling import has_recurrent_layers

    if has_recurrent_layers(model):  # a right-padded prompt's recurrent state has run over its padding
        return False
    chunk = getattr(text, "attention_chunk_size", None)
    floor = getattr(text, "floor_scale", None) if getattr(text, "attn_temperature_tuning", False) else None
    return (bool(getattr(text, "use_cache", True)) and not ckpt and (not window or window >= length)
            and (not chunk or chunk >= length) and (not floor or floor > length))


def _shared_prefix_hidden(model: torch.nn.Module, packed: Packed, prompts: list[list[int]], which: list[int],
                          device) -> torch.Tensor:
    """[B, width, H]: column t holds the hidden state that predicts completion token t.

    Each distinct prompt runs once (right-padded: no query row is fully masked); its keys and values, with their
    autograd history, are repeated for the rows that share it, and the completions run on top of
    them. The same numbers as one forward over every ``prompt + completion`` row, without running
    a group's prompt G times forward and backward.
    """
    from transformers import DynamicCache

    from grpo.foundation.modeling import CACHE_ARG, cache_of

    U, Lp = len(prompts), max(len(p) for p in prompts)
    p_ids = torch.zeros((U, Lp), dtype=torch.long)  # right padding, masked: any id will do
    p_att = torch.zeros((U, Lp), dtype=torch.long)
    for i, p in enumerate(prompts):
        p_ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        p_att[i, : len(p)] = 1
    p_ids, p_att = p_ids.to(device), p_att.to(device)
    p_len = p_att.sum(-1)
    out = _decoder_stack(model)(input_ids=p_ids, attention_mask=p_att, **{CACHE_ARG: DynamicCache()}, use_cache=True)
    cache = cache_of(out)
    h_last = out.last_hidden_state[torch.arange(U, device=device), p_len - 1]  # predicts completion token 0
    idx = torch.tensor(which, dtype=torch.long, device=device)
    cache.batch_select_indices(idx)  # differentiable: the rows' gradients add up in the shared prompt
    width = packed.width
    if width > 1:  # the completions run padded to the longest one here, not to the batch's width (kept > 1:
        width = max(2, min(width, max(packed.length.tolist())))  # ZeRO-3 ranks agree on running this pass)
    start, length = packed.start.to(device), packed.length.to(device)
    if width > 1:
        cols = torch.arange(width - 1, device=device)
        c_pos = start.unsqueeze(1) + cols.unsqueeze(0)  # [B, width - 1] absolute positions
        c_att = (cols.unsqueeze(0) < length.unsqueeze(1) - 1).long()
        full_ids = packed.input_ids.to(device)
        c_ids = full_ids.gather(1, c_pos.clamp(max=full_ids.shape[1] - 1))
        att = torch.cat([p_att[idx], c_att], dim=1)
        h_c = _decoder_stack(model)(input_ids=c_ids, attention_mask=att, position_ids=c_pos, **{CACHE_ARG: cache},
                               use_cache=True).last_hidden_state
        return torch.cat([h_last[idx].unsqueeze(1), h_c], dim=1)
    return h_last[idx].unsqueeze(1)


@dataclass
class Scores:
    """What :func:`completion_scores` computes for each completion token (every tensor [B, width, ...], 0 beyond a
    row's length)."""

    logprobs: torch.Tensor  # [B, width] log-probs of the completion tokens
    entropy: Optional[torch.Tensor] = None  # [B, width] (``with_entropy``)
    sum_pi_squared: Optional[torch.Tensor] = None  # [B, width] sum_v pi_v^2, detached (``sum_pi_squared``)
    gathered: Optional[torch.Tensor] = None  # [B, width, m] log-probs of ``gather_ids`` (differentiable)
    topk_logprobs: Optional[torch.Tensor] = None  # [B, width, k] the k most likely next tokens' log-probs (no grad)
    topk_ids: Optional[torch.Tensor] = None  # [B, width, k] their ids, most likely first


def completion_scores(
    model: torch.nn.Module,
    packed: Packed,
    temperature: float = 1.0,
    chunk_size: int = 0,
    with_entropy: bool = False,
    share_prefix: bool = True,
    entropy_grad: bool = False,
    sum_pi_squared: bool = False,
    gather_ids: Optional[torch.Tensor] = None,
    top_k: int = 0,
) -> Scores:
    """Log-probs of each row's completion tokens, and what else is asked, from one forward pass (:class:`Scores`).

    ``gather_ids`` [B, width, m]: also the log-probs of these m tokens at each completion position, with their
    gradient (a teacher's top-k, where the student's distribution is compared over the teacher's support).
    ``top_k``: also the k most likely next tokens at each completion position, without gradient (what a teacher or
    a reference sends). Rows that share a prompt (a group) run it once (``share_prefix``; see
    :func:`_shared_prefix_hidden`); the LM head runs on completion positions only.
    """
    device = next(model.parameters()).device
    ids = packed.input_ids.to(device)
    B, width = ids.shape[0], packed.width
    # which (row, column) pairs hold a completion token: found on the host, where the lengths are (a nonzero
    # on the device would make the host wait for it), then copied over
    valid = np.arange(width)[None, :] < packed.length.cpu().numpy()[:, None]  # [B, width]
    rows, tcols = (torch.from_numpy(x).to(device, non_blocking=True) for x in valid.nonzero())
    pos = packed.start.to(device)[rows] + tcols  # position of the completion token
    targets = ids[rows, pos]
    if gather_ids is not None:  # [n, 1 + m]: the sampled token, then the asked ones
        targets = torch.cat([targets.unsqueeze(-1), gather_ids.to(device)[rows, tcols]], dim=-1)
    prompts, which = _prompt_groups(packed) if share_prefix and B > 1 else ([], [])
    share = bool(prompts) and len(prompts) < B and _can_share_prefix(model, ids.shape[1])
    if partitioned(model):  # ZeRO-3: one forward pass or two (prompts, then completions) on every rank alike
        share = not dist.any_rank(not (share and width > 1))
    if share:
        h = _shared_prefix_hidden(model, packed, prompts, which, device)[rows, tcols]
    else:
        hidden = _decoder_stack(model)(input_ids=ids, attention_mask=packed.attention_mask.to(device)).last_hidden_state
        h = hidden[rows, pos - 1]
    softcap = getattr(text_config(model), "final_logit_softcapping", None)
    scale = logit_scale(model)
    if scale != 1.0:  # scaled logits at temperature T are the head's at temperature T / scale
        if softcap:
            raise NotImplementedError(f"{text_config(model).model_type}: both a logit scale and a soft-cap")
        temperature = temperature / scale
    head = model.get_output_embeddings()
    lp, ent, *sq = head_logprobs(head, h, targets, temperature, chunk_size, with_entropy,
                                 softcap, entropy_grad=entropy_grad, sum_pi_squared=sum_pi_squared)

    def spread(values: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [B, width, ...], zeros elsewhere
        return torch.zeros(B, width, *values.shape[1:], dtype=values.dtype, device=device).index_put((rows, tcols), values)

    out = Scores(spread(lp[:, 0] if gather_ids is not None else lp))
    if gather_ids is not None:
        out.gathered = spread(lp[:, 1:])
    if ent is not None:
        out.entropy = spread(ent)
    if sum_pi_squared:
        out.sum_pi_squared = spread(sq[0])
    if top_k:
        topk_lp, topk_ids = head_topk(head, h, top_k, temperature, chunk_size, softcap)
        out.topk_logprobs, out.topk_ids = spread(topk_lp), spread(topk_ids)
    return out
