"""The ``hf`` engine: sampling G completions per prompt with the training model itself.

Each prompt is prefilled once; its KV cache is repeated for the G samples of its group,
and sequences that have emitted EOS leave the decode batch, so they stop costing compute.
Under ZeRO-3 with more than one rank, generation is collective (``needs_synced_generation``).

Multi-turn rollouts (``env`` set): the engine keeps the KV cache of every row of its last call
(``PrefixStore``). A later prompt that starts with such a row (the next turn: the row, then the
environment's observation) prefills only what follows the longest kept prefix, so a turn costs
its new tokens, not the whole trajectory again. The store is dropped when the weights change.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

try:  # the conv and recurrent states of transformers' linear-attention layers (Qwen3.5, Qwen3-Next, LFM2, ...)
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - a transformers without them has no such layers either
    LinearAttentionCacheLayerMixin = ()

from grpo.foundation import dist
from grpo.foundation.config import ConfigError
from grpo.foundation.modeling import CACHE_ARG, cache_of, new_cache
from grpo.rollout.engine import Completions, DecodeTally, EngineSetup, SamplingParams, forced_eos, with_fetch


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                u: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row from temperature / top-k / top-p filtered logits (``u``: see ``sample_categorical``)."""
    return sample_categorical(filter_logits(logits, temperature, top_p, top_k), u)


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """float32 logits / temperature with the tokens outside top-k and top-p set to -inf: the distribution
    the sampler draws from (its log-softmax is the sampler's "processed" log-probs). No host sync."""
    return _filtered(logits.float(), temperature, top_p, top_k)


def token_logprobs(logits: torch.Tensor, tok: torch.Tensor, temperature: float, top_p: float,
                   top_k: int) -> torch.Tensor:
    """The sampler's log-prob of each drawn token [rows]: log-softmax of the filtered logits at ``tok``, in float64
    when the model computes in float64 (else float32). No host sync."""
    z = _filtered(logits if logits.dtype == torch.float64 else logits.float(), temperature, top_p, top_k)
    return torch.log_softmax(z, dim=-1).gather(-1, tok[:, None]).squeeze(-1)


def _filtered(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_categorical(logits: torch.Tensor, u: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One index per row, drawn with probability softmax(logits), by inverting the cumulative distribution.

    Exactly the distribution of ``torch.multinomial(softmax(logits), 1)``, at a fraction of its
    cost on CPU (one cumsum and a binary search instead of multinomial's per-row setup: 0.7 ms
    against 14 ms for 16 rows of a 49k vocabulary). Tokens of probability 0 are never drawn: the
    uniform is kept strictly below the total mass, and ``right=True`` skips flat (zero) steps.
    ``u``: the [rows, 1] uniforms to use (drawn here when None).
    """
    w = (logits - logits.amax(-1, keepdim=True)).exp_()  # unnormalised: u is scaled by the total
    cdf = w.cumsum_(-1)  # non-negative terms: non-decreasing in floating point too
    total = cdf[:, -1:]
    if u is None:
        u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device)
    u = u.to(cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


class _GrowLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer with room for the whole completion.

    Appending a token writes it in place and the layer hands out views of the filled part, where
    DynamicLayer copies its whole cache (``torch.cat``) at every step: a cost that grows with the
    context, so decoding was quadratic in the completion length. Rows leave the batch as before.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, extra: int):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.length = keys.shape[-2]
        room = self.length + max(extra, 1)  # keys and values may differ in width (MLA caches two latents)
        self._k = keys.new_empty((*keys.shape[:-2], room, keys.shape[-1]))
        self._v = values.new_empty((*values.shape[:-2], room, values.shape[-1]))
        self._k[..., : self.length, :] = keys
        self._v[..., : self.length, :] = values
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self._k.shape[-2]:  # out of room (not expected): grow like DynamicLayer
            self._k = torch.cat([self.keys, key_states], dim=-2)
            self._v = torch.cat([self.values, value_states], dim=-2)
        else:
            self._k[..., self.length : self.length + n, :] = key_states
            self._v[..., self.length : self.length + n, :] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()
        else:
            super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k, self._v = self._k.repeat_interleave(repeats, dim=0), self._v.repeat_interleave(repeats, dim=0)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``: their filled columns are gathered into the first rows of the same
        buffer, which is then narrowed (no new whole-buffer allocation or copy of the empty columns)."""
        n = indices.numel()
        if n > self._k.shape[0]:  # more rows than the buffer holds (not a selection): a new buffer
            self._k, self._v = self._k[indices], self._v[indices]
        else:
            L = self.length
            self._k[:n, ..., :L, :] = self._k[indices, ..., :L, :]  # the right side is gathered first
            self._v[:n, ..., :L, :] = self._v[indices, ..., :L, :]
            self._k, self._v = self._k[:n], self._v[:n]
        self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self._k.device))

    def drop_columns(self, d: int) -> None:
        """Drop the first ``d`` columns (no row attends them any more): the rest move to the buffer's start."""
        L = self.length
        self._k[..., : L - d, :] = self._k[..., d:L, :].clone()
        self._v[..., : L - d, :] = self._v[..., d:L, :].clone()
        self.length = L - d
        self._views()

    def reset(self) -> None:
        self.length = 0
        self._views()


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep the batch rows ``rows`` (in that order; repeated indices repeat a row) of every layer: keys and values,
    and a recurrent layer's conv and recurrent states (transformers' linear-attention layers have no row selection
    of their own: their beam-search reorder is one)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            LinearAttentionCacheLayerMixin.reorder_cache(layer, rows)
            if isinstance(layer, DynamicLayer) and layer.is_initialized:  # a hybrid layer's keys and values too
                DynamicLayer.batch_select_indices(layer, rows)
        else:
            layer.batch_select_indices(rows)


def _make_room(cache: DynamicCache, extra: int) -> None:
    """Turn the cache's plain layers into in-place growing ones with room for ``extra`` more positions
    (sliding-window and other special layers are left as they are)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = _GrowLayer(layer.keys, layer.values, extra)


def _join_rows(cache: DynamicCache, att: torch.Tensor, new: DynamicCache, new_att: torch.Tensor,
               extra: int) -> tuple[DynamicCache, torch.Tensor]:
    """Continuous batching: the rows of ``new`` (just prefilled) after those of ``cache``, both right-aligned at the
    column the next step writes (the narrower side left-padded with masked zero columns), every layer with room for
    ``extra`` more positions; (the joined cache, its attention mask)."""
    W, Wn = att.shape[1], new_att.shape[1]
    Wm = max(W, Wn)

    def left(x: torch.Tensor, d: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 0, d, 0)) if d else x

    for i, (a, b) in enumerate(zip(cache.layers, new.layers)):
        cache.layers[i] = _GrowLayer(torch.cat([left(a.keys, Wm - W), left(b.keys, Wm - Wn)]),
                                     torch.cat([left(a.values, Wm - W), left(b.values, Wm - Wn)]), extra)
    return cache, torch.cat([torch.nn.functional.pad(att, (Wm - W, 0)), torch.nn.functional.pad(new_att, (Wm - Wn, 0))])


class PrefixStore:
    """The rows of one ``generate`` call with their KV cache: row j is ``prompt_j + tokens_j`` and its cache
    holds every position but the last (the last token was sampled, never fed), per layer a keys and a
    values tensor [heads, length, head_dim]."""

    def __init__(self):
        self.rows: list[list[int]] = []
        self.kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._by_prompt: dict[tuple[int, ...], list[int]] = {}  # the call's prompt -> its rows
        self._prompt_lengths: set[int] = set()

    def add(self, prompt: list[int], tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._by_prompt.setdefault(tuple(prompt), []).append(len(self.rows))
        self._prompt_lengths.add(len(prompt))
        self.rows.append(prompt + tokens)
        self.kv.append(kv)

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(row, c): the kept row sharing the longest prefix with ``prompt`` (it must contain that row's
        own prompt), and how many of its cached positions serve ``prompt`` (at most ``len(prompt) - 1``:
        the last prompt token is always fed, its logits start the sampling); (-1, 0) when none does."""
        best, best_c = -1, 0
        for n in self._prompt_lengths:
            for j in self._by_prompt.get(tuple(prompt[:n]), ()):
                row, c = self.rows[j], n
                limit = min(len(row) - 1, len(prompt) - 1)
                while c < limit and row[c] == prompt[c]:
                    c += 1
                c = min(c, limit)
                if c > best_c:
                    best, best_c = j, c
        return best, best_c


def _prefill(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, device: torch.device,
             store: Optional[PrefixStore]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One forward pass over the prompts: (cache, last logits, attention mask, last positions, positions
    taken from ``store``).

    Prompts are left-padded. With ``store``, each prompt's longest kept prefix comes from there (its
    keys and values right-aligned in the cache's first columns, the attention mask 0 before them) and only
    the rest of the prompt is fed (left-padded after them): a row reads [pad, kept, pad, new]."""
    P = len(prompts)
    matches = [store.match(p) for p in prompts] if store is not None else [(-1, 0)] * P
    C = max(c for _, c in matches)
    suffixes = [p[c:] for p, (_, c) in zip(prompts, matches)]
    S = max(len(x) for x in suffixes)
    ids = torch.full((P, S), pad_id, dtype=torch.long, device=device)
    att = torch.zeros((P, C + S), dtype=torch.long, device=device)
    for i, (x, (_, c)) in enumerate(zip(suffixes, matches)):
        ids[i, S - len(x):] = torch.tensor(x, dtype=torch.long)
        att[i, C - c: C] = 1
        att[i, C + S - len(x):] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(model)
    if C:
        kept = [store.kv[j] if j >= 0 else None for j, _ in matches]
        some = next(kv for kv in kept if kv is not None)
        for layer, (k0, v0) in enumerate(some):
            keys = k0.new_zeros((P, k0.shape[0], C, k0.shape[-1]))
            values = v0.new_zeros((P, v0.shape[0], C, v0.shape[-1]))
            for i, (kv, (_, c)) in enumerate(zip(kept, matches)):
                if c:
                    keys[i, :, C - c:] = kv[layer][0][:, :c]
                    values[i, :, C - c:] = kv[layer][1][:, :c]
            cache.update(keys, values, layer)
    out = model(input_ids=ids, attention_mask=att, position_ids=pos[:, C:], **{CACHE_ARG: cache}, use_cache=True,
                logits_to_keep=1)
    return cache_of(out), out.logits[:, -1], att, pos[:, -1], sum(c for _, c in matches)


def _keep_rows(cache: DynamicCache, rows: torch.Tensor, att: Optional[torch.Tensor],
               prompts: list[list[int]], tokens: list[list[int]], store: PrefixStore) -> None:
    """Copy the cache of the batch rows ``rows`` into ``store``: their first ``len(prompt) + len(tokens) - 1``
    attended columns (every fed position: the last token was never fed; a row that finished before the host read
    ran on past them)."""
    for b, prompt, toks in zip(rows.tolist(), prompts, tokens):
        fed = len(prompt) + len(toks) - 1
        cols = att[b].nonzero(as_tuple=True)[0][:fed] if att is not None else slice(0, fed)
        store.add(prompt, toks, [(layer.keys[b][:, cols].clone(), layer.values[b][:, cols].clone())
                                 for layer in cache.layers])


def needs_synced_generation(zero_stage: int) -> bool:
    """ZeRO-3 gathers each layer's weights with a collective inside every forward pass, so all ranks
    must run the same number of forwards: a rank that is done (or has no prompts) keeps joining in."""
    return zero_stage == 3 and dist.world_size() > 1


def _join_forward(model: torch.nn.Module, pad_id: int, device: torch.device) -> None:
    """A one-token forward whose only purpose is to take part in the other ranks' weight gathers."""
    model(input_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device), use_cache=False, logits_to_keep=1)


def default_check_every(device: torch.device) -> int:
    """Decode steps between the host's reads of which rows have finished: every step on a CPU (a read
    costs nothing there and finished rows leave at once), every 8 on an accelerator, where each read
    drains the device's queue (finished rows then run up to 7 more steps, their tokens thrown away)."""
    return 1 if torch.device(device).type == "cpu" else 8


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    n: int = 1,
    synced: bool = False,
    reuse: Optional[PrefixStore] = None,
    keep: Optional[PrefixStore] = None,
    check_every: Optional[int] = None,
    logprobs: bool = False,
    room: Optional[list[int]] = None,
    stop: Optional[Callable[[list[int]], bool]] = None,
    tally: Optional[DecodeTally] = None,
    slots: int = 0,
    carry: Optional[PrefixStore] = None,
) -> Completions:
    """``n`` completions per prompt, group-major.

    ``synced`` (see ``needs_synced_generation``): collective; every rank must call it, with or without
    prompts, and each keeps running forwards until the last row on any rank has finished.
    ``reuse``: prompts start from the longest prefix kept there (``PrefixStore``); ``keep``: every row's
    cache is copied there as it finishes. ``Completions.reused`` counts the prompt positions not fed again.
    ``check_every``: decode steps between host reads of the finished rows (``default_check_every``); the
    only host synchronisations of the loop are these reads (and, synced, one all-reduce each). Each row
    draws its uniforms from one [rows] draw per step, so the tokens do not depend on ``check_every``.
    ``logprobs``: also the sampler's log-prob of each drawn token (``Completions.logprobs``; one log-softmax
    over the vocabulary per step, so only when asked).
    Streaming (grpo/rollout/stream.py): ``room`` caps each prompt's rows at their own token count (at most
    ``params.max_tokens``); ``stop``, called with the rows finished so far at each host read (and a function giving
    finished rows' tokens), ends the call when it returns True, the unfinished rows returned as they stand
    (``Completions.stopped``). Not with ``synced``.
    ``slots`` (continuous batching, ``rollout.slots``): at most that many rows decode at once; a row that leaves
    (at a host read) gives its place to the next waiting row, whose prompt is prefilled and joined to the batch (its
    KV right-aligned with the other rows' columns; the columns no row attends any more are dropped). Row r then draws
    uniform [k, r] for its k-th token, so its tokens do not depend on the slot count. Not with ``synced``.
    ``tally``: the call's decode figures added to (row-steps over the call's slots, or its first batch), its prefills
    timed.
    ``carry`` (streamed calls, ``rollout.carried_kv: keep``): the cache of every row cut by ``stop`` is copied there
    (a later call's ``reuse``), so that the row goes on without its prompt and tokens prefilled again.
    """
    G, cfg, stop = n, params, with_fetch(stop)
    device = next(model.parameters()).device
    k = check_every or default_check_every(device)
    was_training = model.training
    model.eval()
    # ignore_eos: no token ends a row, every completion is max_completion_length long
    eos = torch.tensor([] if cfg.ignore_eos else sorted(eos_ids), dtype=torch.long, device=device)
    P = len(prompts)
    R, T = P * G, cfg.max_tokens
    if room is not None and (len(room) != P or not all(0 < x <= T for x in room)):
        raise ValueError(f"room: one count per prompt in 1..{T} (max_tokens), got {room}")
    if synced and stop is not None:
        raise ValueError("stop: a synced (ZeRO-3) generation call ends on every rank at once; it cannot stop one")
    slotted = slots > 0 and R > 0
    if slotted and synced:
        raise ValueError("slots: a synced (ZeRO-3) generation call runs one forward a step on every rank, which a row's "
                         "prefill mid-call would break; set rollout.slots=0")
    S = min(slots, R) if slotted else R  # rows decoding at once
    # streamed or slotted: each row's last token index, where it ends (truncated unless that token is an EOS)
    caps = None if room is None and not slotted else [T if room is None else room[r // G] for r in range(R)]
    last = None if caps is None else torch.tensor([c - 1 for c in caps], dtype=torch.long, device=device)
    result = torch.full((R, T), pad_id, dtype=torch.long, device=device)
    forced = None if cfg.ignore_eos or not eos_ids else forced_eos(cfg, R, device)
    result_lp = torch.zeros((R, T), dtype=torch.float64, device=device) if logprobs else None
    K = cfg.topk_logprobs  # the audit's: the k most likely tokens of each step's distribution
    top_lp = torch.zeros((R, T, K), dtype=torch.float32, device=device) if K else None
    top_ids = torch.zeros((R, T, K), dtype=torch.long, device=device) if K else None
    # slotted: a row's length is set when it ends (or is cut); rows never started have none
    lengths = torch.full((R,), 0 if slotted else T, dtype=torch.long, device=device)
    finished = torch.zeros(R, dtype=torch.bool, device=device)  # EOS drawn (the row may not have left yet)
    active = torch.arange(R if not slotted else 0, device=device)
    reused, cut, steps = 0, False, 0
    # slotted: row r draws uniform [k, r] for its k-th token, whichever rows decode beside it
    U = torch.rand((T, R), device=device) if slotted else None
    waiting = 0 if slotted else R  # slotted: the first row not yet started
    start = active.new_zeros(0)  # slotted: the step of each active row's first token
    ends: list[int] = []  # slotted: the step at which each active row reaches its cap (the host reads it then)
    att = None  # slotted: the attention mask over the cache's columns

    def fetch(rows: list[int]) -> list[list[int]]:  # finished rows' tokens, for ``stop``
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        return [row[:m] for row, m in zip(result[idx].tolist(), lengths[idx].tolist())]

    def timed():  # a prefill, timed into ``tally``
        return tally.prefill(device) if tally is not None else contextlib.nullcontext()

    def admit(m: int) -> None:
        """Slotted: the next ``m`` waiting rows join the batch at step t, their prompts prefilled (each once)."""
        nonlocal cache, logits, att, next_pos, active, start, waiting, reused
        rows = list(range(waiting, waiting + m))
        waiting += m
        firsts = {q: i for i, q in enumerate(sorted({r // G for r in rows}))}
        with timed():
            c2, lg, a2, lpos, re = _prefill(model, [prompts[q] for q in firsts], pad_id, device, reuse)
        reused += re
        _make_room(c2, T)
        if not all(isinstance(layer, _GrowLayer) for layer in c2.layers):
            raise ValueError(f"rollout.slots: the hf engine refills slots in plain attention caches; "
                             f"{type(model).__name__} has sliding-window or recurrent layers: set rollout.slots=0, or "
                             f"rollout.engine=static")
        at = torch.tensor([firsts[r // G] for r in rows], device=device)
        select_rows(c2, at)
        if active.numel():
            cache, att = _join_rows(cache, att, c2, a2[at], T)
            logits, next_pos = torch.cat([logits, lg[at]]), torch.cat([next_pos, lpos[at] + 1])
        else:
            cache, att, logits, next_pos = c2, a2[at], lg[at], lpos[at] + 1
        active = torch.cat([active, torch.tensor(rows, device=device)])
        start = torch.cat([start, start.new_full((m,), t)])
        ends.extend(t + caps[r] - 1 for r in rows)

    t = 0
    if slotted:
        cache = logits = next_pos = None
        admit(S)
        Lp, att_all = 0, None
    elif P:
        with timed():
            cache, logits, att, last_pos, reused = _prefill(model, prompts, pad_id, device, reuse)
        Lp = att.shape[1]
        _make_room(cache, T)
        if G > 1:  # each prompt's keys, values and states, G times
            select_rows(cache, torch.arange(P, device=device).repeat_interleave(G))
        logits = logits.repeat_interleave(G, dim=0)
        # The attention mask of every step is a view of one buffer; with no padding none is needed.
        padded = not bool(att.all())
        att_all = torch.cat([att, att.new_ones(P, T)], dim=1).repeat_interleave(G, dim=0) if padded else None
        next_pos = last_pos.repeat_interleave(G) + 1
    elif synced:
        _join_forward(model, pad_id, device)  # the other ranks' prefill
    if P and not all(isinstance(layer, _GrowLayer) for layer in cache.layers):
        keep = carry = None  # sliding-window or other special layers: their rows are not kept

    while True:
        deadline = min(ends, default=t) if slotted else T - 1  # a row at its cap must leave at this read
        check = (t + 1) % k == 0 or t >= deadline or (not synced and not active.numel())
        if active.numel():
            at = t if not slotted else t - start  # each row's token index
            # row r's uniform whichever rows are still here
            u = torch.rand((R, 1), device=device)[active] if not slotted else U[at, active].unsqueeze(1)
            tok = sample_next(logits, cfg.temperature, cfg.top_p, cfg.top_k, u)
            if forced is not None:  # benchmarks: the row's recorded length is reached
                tok = torch.where(forced[active] == at + 1, eos[0], tok)
            result[active, at] = tok
            if result_lp is not None:
                result_lp[active, at] = token_logprobs(logits, tok, cfg.temperature, cfg.top_p, cfg.top_k).double()
            if K:
                top = torch.log_softmax(logits.float() / cfg.temperature, dim=-1).topk(K, dim=-1)
                top_lp[active, at], top_ids[active, at] = top.values, top.indices
            was = finished[active]
            if eos.numel() or last is not None:
                now = torch.isin(tok, eos) if eos.numel() else torch.zeros_like(was)
                if last is not None:  # the row's room is full (at max_tokens every row ends anyway)
                    now = now | (last[active] == at)
                now = now & ~was
                lengths[active] = torch.where(now, at + 1, lengths[active])
                was = was | now
                finished[active] = was
            if check:
                leave = was if slotted or t < T - 1 else torch.ones_like(was)  # at T every row ends (truncated unless EOS)
                if stop is not None and stop(finished.nonzero(as_tuple=True)[0].tolist(), fetch):
                    cut = True  # the rows still decoding keep their tokens so far
                    lengths[active] = torch.where(was, lengths[active], at + 1)
                    if carry is not None:  # the unfinished rows' caches, for the call that carries them on
                        going = (~was).nonzero(as_tuple=True)[0]
                        rows = active[going].tolist()
                        _keep_rows(cache, going, att if slotted else att_all, [prompts[r // G] for r in rows],
                                   [result[r, :m].tolist() for r, m in zip(rows, lengths[active[going]].tolist())],
                                   carry)
                    break
                stay = (~leave).nonzero(as_tuple=True)[0]  # the loop's one host read of these k steps
                if stay.numel() < active.numel():
                    if keep is not None:
                        gone = leave.nonzero(as_tuple=True)[0]
                        rows = active[gone].tolist()
                        ends_at = lengths[active[gone]].tolist()
                        _keep_rows(cache, gone, att if slotted else att_all, [prompts[r // G] for r in rows],
                                   [result[r, :e].tolist() for r, e in zip(rows, ends_at)], keep)
                    if not stay.numel():
                        active = active[:0]
                        if slotted:
                            start, ends[:] = start[:0], []
                    else:  # finished rows leave the batch and its KV cache
                        select_rows(cache, stay)
                        active, tok, next_pos = active[stay], tok[stay], next_pos[stay]
                        if att_all is not None:
                            att_all = att_all[stay]
                        if slotted:
                            start, att = start[stay], att[stay]
                            ends[:] = [ends[i] for i in stay.tolist()]
                            lead = int(att.any(0).to(torch.int8).argmax())  # columns no row attends any more
                            if lead:
                                for layer in cache.layers:
                                    layer.drop_columns(lead)
                                att = att[:, lead:]
        t += 1
        if check and not (dist.any_rank(active.numel() > 0) if synced else active.numel() > 0 or waiting < R):
            break
        if active.numel():
            if slotted:
                att = torch.cat([att, att.new_ones(att.shape[0], 1)], dim=1)
            out = model(
                input_ids=tok.unsqueeze(1),
                attention_mask=att if slotted else None if att_all is None else att_all[:, : Lp + t],
                position_ids=next_pos.unsqueeze(1), **{CACHE_ARG: cache}, use_cache=True,
            )
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
            steps += 1
        elif not slotted:
            _join_forward(model, pad_id, device)
            continue
        if waiting < R and active.numel() < S:  # slotted: the free slots take the next rows
            admit(min(S - active.numel(), R - waiting))
    if was_training:
        model.train()
    lengths_l = lengths.tolist()
    rows = result.tolist()
    tokens = [row[:n] for row, n in zip(rows, lengths_l)]
    eos_set = set(int(e) for e in eos_ids)
    truncated = torch.tensor([not (len(tk) and tk[-1] in eos_set) for tk in tokens], dtype=torch.bool)
    stopped = ~finished.cpu() if cut else None
    if stopped is not None:
        truncated &= ~stopped
    lps = None if result_lp is None else [row[:m] for row, m in zip(result_lp.tolist(), lengths_l)]
    out = Completions(tokens=tokens, truncated=truncated, logprobs=lps, reused=reused, stopped=stopped)
    if tally is not None:  # a row's first token came from the prefill
        tally.add(sum(lengths_l) - sum(m > 0 for m in lengths_l), steps * S, steps)
    if K:  # zeros past each row's end (a finished row's slots may hold its last steps' values)
        past = (torch.arange(T, device=device).unsqueeze(0) >= lengths.unsqueeze(1)).unsqueeze(-1)
        out.topk_logprobs = top_lp.masked_fill(past, 0.0).cpu()
        out.topk_ids = top_ids.masked_fill(past, 0).cpu()
    return out


class HFEngine:
    """The training model generates (``rollout.engine: hf``, the default): nothing to sync, it *is* the policy.

    With an environment (multi-turn rollouts) it keeps the rows of its last call (``PrefixStore``), so the
    next turn prefills only its new tokens; ``offload`` (the rollout is over) and ``sync_weights`` drop them."""

    def __init__(self, setup: EngineSetup):
        self.setup = setup
        self.keeps = bool(setup.cfg.env.name)
        self.store: Optional[PrefixStore] = None
        # streaming (rollout.carried_kv: keep): the caches of the rows the last streamed call cut, kept through the
        # weight sync and the training passes, for the call that carries them on
        self.carries = setup.cfg.rollout.carried_kv == "keep"
        self.carried: Optional[PrefixStore] = None
        self.metrics: dict[str, float] = {}
        self.decoded = DecodeTally()  # since the last pop_metrics
        a = setup.cfg.algo  # the sampler's log-probs, when the run uses them
        self.logprobs = a.tis_cap is not None or a.rollout_correction is not None
        self.slots = setup.cfg.rollout.slots  # continuous batching: rows decoded at once (0: every row of a call)
        if self.slots and setup.synced:
            raise ConfigError(f"rollout.slots={self.slots} with the hf engine and train.zero_stage=3 over several ranks: "
                              f"ZeRO-3 makes every forward a collective, and a row's prefill mid-call would put the "
                              f"ranks out of step; set rollout.slots=0, or rollout.engine=static")

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int, room: Optional[list[int]] = None,
                 stop: Optional[Callable[[list[int]], bool]] = None) -> Completions:
        """``room`` and ``stop``: a streamed call (``generate``'s)."""
        s = self.setup
        keep = PrefixStore() if self.keeps else None
        carry = PrefixStore() if self.carries and stop is not None else None
        reuse = self.carried if carry is not None else self.store
        with self.decoded.call():
            out = generate(s.model, prompts, params, s.eos_ids, s.pad_id, n=n, synced=s.synced, reuse=reuse,
                           keep=keep, logprobs=self.logprobs, room=room, stop=stop, tally=self.decoded, slots=self.slots,
                           carry=carry)
        self.store = keep
        if carry is not None:
            self.carried = carry
            self.metrics["rollout/kept_tokens"] = self.metrics.get("rollout/kept_tokens", 0.0) + out.reused
        if self.keeps:
            fed = sum(len(p) for p in prompts) - out.reused
            self.metrics["rollout/prefill_tokens"] = self.metrics.get("rollout/prefill_tokens", 0.0) + fed
            self.metrics["rollout/reused_tokens"] = self.metrics.get("rollout/reused_tokens", 0.0) + out.reused
        return out

    def sync_weights(self) -> None:
        self.store = None  # kept caches were computed with the old weights (carried ones stay: carried_kv keep)

    def offload(self) -> None:
        """The rollout is over and the training passes come: the kept caches (every row's, about 3 GB for
        SmolLM2-135M at 64 x 1024 tokens) are freed now, not at the next sync after those passes."""
        self.store = None

    def pop_metrics(self) -> dict[str, float]:
        """The engine's counts since the last call: prefix reuse (multi-turn), and ``rollout/occupancy``, the share
        of decode row-steps that drew a token of an unfinished row, over each call's slots (``rollout.slots``) or else its
        first batch (finished rows
        leave the batch, but on an accelerator a decode step costs about its weights' reads however few rows are
        left)."""
        out, self.metrics = self.metrics, {}
        out.update(self.decoded.pop())
        return out

    def pop_timings(self) -> dict[str, float]:
        """The generation calls' time split since the last call (``DecodeTally.pop_timings``)."""
        return self.decoded.pop_timings()
