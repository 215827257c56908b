"""The family-agnostic engine: KV buffers, row and length buckets, CUDA graphs and ``StaticEngine`` (prefill, decode,
compaction, ZeRO-3 gathering, LoRA merging)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from grpo.foundation import dist, lora
from grpo.foundation.config import ConfigError
from grpo.foundation.logprobs import partitioned
from grpo.rollout.engine import Completions, DecodeTally, EngineSetup, SamplingParams, forced_eos, with_fetch
from grpo.rollout.static import delta_net
from grpo.rollout.static.layers import forward, sample
from grpo.rollout.static.spec import LENGTH_BUCKET, ModelSpec, model_spec, unsupported_reason
from grpo.rollout.static.weights import Weights, read_weights


def new_buffers(spec: ModelSpec, rows: int, length: int, dtype: torch.dtype, device) -> tuple[list, list]:
    """Each layer's two buffers: an attention layer's keys and values [rows, kv_heads, length, head_dim] (zeros, not
    empty: masked keys still multiply their values by 0, and 0 * NaN is NaN); a Gated DeltaNet layer's convolution
    window and recurrent state (``delta_net.new_state``); a Gemma 4 layer that shares another's KV, that layer's
    very tensors."""
    ks, vs = [], []
    for i in range(spec.layers):
        if spec.linear is not None and spec.linear[i]:
            k, v = delta_net.new_state(spec.delta, rows, dtype, device)
        elif spec.kv_source is not None and spec.kv_source[i] != i:
            k, v = ks[spec.kv_source[i]], vs[spec.kv_source[i]]
        else:
            kv, d = spec.layer_dims[i] if spec.layer_dims else (spec.kv_heads, spec.head_dim)
            k = torch.zeros((rows, kv, length, d), dtype=dtype, device=device)
            v = torch.zeros((rows, kv, length, spec.mla[2] if spec.mla else d), dtype=dtype, device=device)
        ks.append(k)
        vs.append(v)
    return ks, vs


def columns(spec: ModelSpec, i: int, length: int) -> Optional[slice]:
    """The part of layer ``i``'s buffers (dim 2) that holds a row's first ``length`` columns: those keys, or a Gated
    DeltaNet layer's whole state; None for a layer that shares another's buffers (moved with that layer's)."""
    if spec.kv_source is not None and spec.kv_source[i] != i:
        return None
    return slice(None) if spec.linear is not None and spec.linear[i] else slice(0, length)


def rows_bucket(n: int) -> int:
    """Rows are padded to a power of two up to 64, then to a multiple of 64."""
    return 1 << max(0, (n - 1).bit_length()) if n <= 64 else -(-n // 64) * 64


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ----------------------------------------------------------------------------- the engine


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The warm-up stream of every graph capture on ``device``: one for the process (see ``capture_graph``)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def capture_graph(run: Callable[[], tuple[torch.Tensor, ...]], pool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """A CUDA graph of ``run`` (after one warm-up run on a side stream) and its output tensors, which every
    ``replay()`` overwrites. Its inputs are whatever tensors ``run`` reads: their storage must stay.

    The side stream is one for the process's life (per device): torch keeps a cuBLAS workspace (32 MiB on an
    H200) for each (handle, stream) a GEMM ran on and never frees it, so a new stream per capture leaked 32 MiB
    a capture, 160 MiB a step at 5 length buckets recaptured after every ``offload`` (H200, docs/results.md)."""
    side = side_stream(torch.cuda.current_stream().device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model (under a PeftModel wrapper, its base)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def resolve_mode(mode: str, device: torch.device) -> str:
    """``rollout.static.mode`` on this device (``auto``: graphs on CUDA, eager elsewhere; compile is opt-in: 1.6x
    graphs' tokens/s on an H200, but it compiles once per length bucket, 67 s for 256 new tokens: docs/gpu.md)."""
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    if "graphs" in mode and device.type != "cuda":
        raise ConfigError(f"rollout.static.mode={mode!r} needs CUDA (graphs are CUDA graphs), and the policy is on "
                          f"{device.type}: use 'eager' or 'compile' (or 'auto')")
    return mode


class StaticEngine:
    """``rollout.engine: static``: see the module's docstring."""

    def __init__(self, setup: EngineSetup):
        reason = unsupported_reason(setup.model)
        if reason is not None:
            raise ConfigError(f"rollout.engine='static' cannot run this model: {reason}; use rollout.engine='hf' "
                              f"(or 'auto', which picks hf for it)")
        self.setup, self.model = setup, setup.model
        self.spec = model_spec(_base(self.model))
        self.device = next(self.model.parameters()).device
        cfg = setup.cfg.rollout.static
        self.mode = resolve_mode(cfg.mode, self.device)
        self.check_every, self.length_bucket = cfg.check_every, cfg.length_bucket
        self.slots = setup.cfg.rollout.slots  # continuous batching: rows decoded at once (0: every row of a call)
        self.decoded = DecodeTally()  # since the last pop_metrics
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(setup.cfg.train.seed * 1_000_003 + dist.rank())  # the engine's own stream
        self.merged: Optional[dict[str, torch.Tensor]] = None  # LoRA: the merged copy (adapted weights only)
        self.owned: Optional[dict[str, torch.Tensor]] = None  # ZeRO-3: the gathered weights
        self.kv: Optional[tuple[list, list, torch.Tensor]] = None  # k, v per layer, kpos (capacity buffers)
        self.graphs: dict[tuple, tuple] = {}  # (rows, length, sampling) -> (graph, static inputs, outputs)
        self.pool = None
        self.pointers: tuple[int, ...] = ()  # the weights' data_ptrs the graphs were captured with
        self.metrics: dict[str, float] = {}
        self.step, self.logits = self._step, self._logits
        if "compile" in self.mode:  # the forward only: Inductor's Triton backend failed on the sampler's 49k-wide
            # cumsum (a split scan, torch 2.11, H200: docs/results.md); the sampler runs eager (captured by graphs)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one per bucket
            # compile_dynamic: sizes that change become symbolic (dynamic=None), else one compile per bucket
            self.logits = torch.compile(self._logits, dynamic=None if cfg.compile_dynamic else False)

    # -- weights
    def weights(self) -> Weights:
        """The step's tensors, read from the module now (LoRA: the merged copy, made at the first call; ZeRO-3:
        gathered once, collectively, and copied into tensors the engine owns)."""
        if partitioned(self.model):
            import deepspeed

            params = dict(self.model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                named = self._own(params)
        elif lora.has_lora(self.model):
            if self.merged is None:
                self.merged = self._merge()
            named = {**lora.base_state_dict(self.model), **self.merged}
        else:
            named = dict(self.model.named_parameters())
        return read_weights(_base(self.model), self.spec, {k: v.detach() for k, v in named.items()})

    def _own(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``named`` in tensors the engine keeps between calls (their pointers stay: no recapture)."""
        if self.owned is None or any(k not in self.owned or self.owned[k].shape != v.shape for k, v in named.items()):
            self.owned = {k: v.detach().clone() for k, v in named.items()}
        else:
            for k, v in named.items():
                self.owned[k].copy_(v.detach())
        return self.owned

    def _merge(self) -> dict[str, torch.Tensor]:
        """The adapted weights (base + scale * B A, and modules_to_save), copies the engine owns."""
        base = lora.base_state_dict(self.model)
        return {k: v.clone() for k, v in lora.merged_state_dict(self.model).items()
                if k not in base or v.data_ptr() != base[k].data_ptr()}

    def sync_weights(self) -> None:
        """LoRA: refresh the merged copy in place (its pointers stay, so captured graphs stay valid). A plain
        policy is read afresh at every call; a weight whose storage moved is seen by the pointer check."""
        if self.merged is None:
            return
        fresh = self._merge()
        for k, v in fresh.items():
            if k in self.merged and self.merged[k].shape == v.shape:
                self.merged[k].copy_(v)
            else:  # a new adapted weight (e.g. a head untied by a reference sync): a new pointer, a recapture
                self.merged[k] = v
        for k in set(self.merged) - set(fresh):  # now the base's own tensor again
            del self.merged[k]

    def pop_metrics(self) -> dict[str, float]:
        """The engine's counts since the last call: compactions, column shifts, and ``rollout/occupancy``, the
        share of decode slot-steps that drew a token of a row, a call's slots being its row bucket at the start
        (a decode step reads every weight however few rows are left, compaction or not)."""
        out, self.metrics = self.metrics, {}
        out.update(self.decoded.pop())
        return out

    def pop_timings(self) -> dict[str, float]:
        """The generation calls' time split since the last call (``DecodeTally.pop_timings``)."""
        return self.decoded.pop_timings()

    def offload(self) -> None:
        """Before the training passes (``rollout.static.offload``): free the KV buffers and the graphs' memory,
        rebuilt and captured again at the next call."""
        if self.setup.cfg.rollout.static.offload:
            self.release()

    def release(self) -> None:
        """Drop the KV buffers, the graphs and their pool, and a ZeRO-3 copy of the weights; on CUDA their memory
        goes back to the device too unless ``rollout.static.empty_cache`` is off."""
        self.kv, self.graphs, self.pool, self.owned = None, {}, None, None
        if self.device.type == "cuda" and self.setup.cfg.rollout.static.empty_cache:
            torch.cuda.empty_cache()

    # -- one decode step (compiled and / or captured)
    def _logits(self, flat: list, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kpos: torch.Tensor, length: int, rope_scale: tuple[float, ...]) -> torch.Tensor:
        return forward(self.spec, Weights.unflat(flat, rope_scale, self.spec), tok[:, None], pos[:, None],
                       col, k, v, kpos, length)

    def _step(self, flat: list, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, u: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, kpos: torch.Tensor, length: int, rope_scale: tuple[float, ...],
              sampling: tuple[float, float, int, int]) -> tuple[torch.Tensor, ...]:
        return sample(self.logits(flat, tok, pos, col, k, v, kpos, length, rope_scale), u, *sampling)

    def _run_step(self, w: Weights, tok, pos, col, u, k, v, kpos, length, sampling):
        if "graphs" not in self.mode:
            return self.step(w.flat(), tok, pos, col, u, k, v, kpos, length, w.rope_scale, sampling)
        key = (tok.shape[0], length, sampling)
        if key not in self.graphs:
            self.graphs[key] = self._capture(w, [tok, pos, col, u], k, v, kpos, length, sampling)
        graph, inputs, out = self.graphs[key]
        for dst, src in zip(inputs, (tok, pos, col, u)):
            dst.copy_(src)
        graph.replay()
        return out

    def _capture(self, w: Weights, inputs: list[torch.Tensor], k, v, kpos, length, sampling):
        """A CUDA graph of one step at these shapes. The warm-up run (which compiles, under compile+graphs)
        performs this very step, so its KV writes are the ones the replay makes."""
        inputs = [x.clone() for x in inputs]
        flat = w.flat()

        def run():
            return self.step(flat, *inputs, k, v, kpos, length, w.rope_scale, sampling)

        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every graph
        graph, out = capture_graph(run, self.pool)
        return graph, inputs, out

    # -- buffers
    def _buffers(self, rows: int, length: int, dtype: torch.dtype):
        """KV buffers with room for ``rows`` x ``length`` (grown when short; graphs then hold stale pointers)."""
        if self.kv is not None:
            kpos = self.kv[2]
            if kpos.shape[0] >= rows and kpos.shape[1] >= length and self.kv[0][0].dtype == dtype:
                return self.kv
            rows, length = max(rows, kpos.shape[0]), max(length, kpos.shape[1])
        self.graphs = {}
        self.kv = (*new_buffers(self.spec, rows, length, dtype, self.device),
                   torch.full((rows, length), -1, dtype=torch.long, device=self.device))
        return self.kv

    # -- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 room: Optional[list[int]] = None, stop: Optional[Callable[[list[int]], bool]] = None) -> Completions:
        """``n`` completions per prompt, group-major. Every distinct prompt is prefilled once; its rows then take
        decode slots: all at once (``rollout.slots`` 0), or ``rollout.slots`` of them (rounded up to the row bucket)
        with a finished row's slot refilled from the rows still waiting (continuous batching): the row's prompt KV
        is copied into the slot's columns ending at the column the next step writes, so every row's columns stay
        one run ending there; when the buffers' last column is reached, the live rows' columns shift left together.
        Row r draws uniform [k, r] for its k-th token in either way, so its tokens do not depend on its slot.

        Streaming (grpo/rollout/stream.py): ``room`` caps each prompt's rows at their own token count (at most
        ``params.max_tokens``); ``stop``, called with the rows finished so far at each host read (and a function
        giving finished rows' tokens: a read of the device, asked only when a group is whole), ends the call when
        it returns True, the unfinished rows returned as they stand (``Completions.stopped``).

        The call's wall time is counted (``time/generation_prefill`` and ``time/generation_decode``)."""
        with self.decoded.call():
            return self._generate(prompts, params, n, room, with_fetch(stop))

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                  room: Optional[list[int]] = None, stop: Optional[Callable[[list[int]], bool]] = None) -> Completions:
        """``generate``'s body."""
        P, G, T = len(prompts), n, params.max_tokens
        w = self.weights()  # under ZeRO-3 a collective: every rank calls generate alike, with or without prompts
        if not P:
            return Completions.empty()
        dev, s, pad = self.device, self.spec, self.setup.pad_id
        if w.pointers() != self.pointers:  # a weight's storage moved: captured graphs read the old one
            self.graphs, self.pointers = {}, w.pointers()
        R, Lp = P * G, max(len(p) for p in prompts)
        if room is not None and (len(room) != P or not all(0 < x <= T for x in room)):
            raise ValueError(f"room: one count per prompt in 1..{T} (max_tokens), got {room}")
        caps = [T] * P if room is None else list(room)
        distinct: dict[tuple, int] = {}
        first_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # each prompt's prefill row
        prompts = [list(p) for p in distinct]
        Rb = pool = rows_bucket(min(R, self.slots or R))  # the call's slots (compaction then narrows Rb)
        queued = R > Rb  # rows wait for a slot: columns to run past a row's cap before they shift
        k_all, v_all, kpos_all = self._buffers(Rb, round_up(Lp + T + (LENGTH_BUCKET if queued else 0), LENGTH_BUCKET),
                                               w.embed.dtype)
        sampling = (params.temperature, params.top_p, params.top_k, params.topk_logprobs)
        K = params.topk_logprobs  # the audit's steps: the top-k of each drawn token's distribution

        # prefill: each distinct prompt once, left-padded to Lp; its KV is then copied to each of its rows' slot
        D = len(prompts)
        ids = torch.full((D, Lp), pad, dtype=torch.long)
        pos = torch.full((D, Lp), -1, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, Lp - len(p):] = torch.tensor(p, dtype=torch.long)
            pos[i, Lp - len(p):] = torch.arange(len(p))
        ids, pos = ids.to(dev), pos.to(dev)
        pk, pv = new_buffers(s, D, Lp, w.embed.dtype, dev)
        pkpos = torch.full((D, Lp), -1, dtype=torch.long, device=dev)
        with self.decoded.prefill(dev):
            first_logits = forward(s, w, ids, pos, torch.zeros(1, dtype=torch.long, device=dev), pk, pv, pkpos, Lp)

        out_tok = torch.full((R + 1, T), pad, dtype=torch.long, device=dev)  # row R: padding slots' and finished
        out_lp = torch.zeros((R + 1, T), dtype=torch.float32, device=dev)  # rows' writes land there
        out_top = (torch.zeros((R + 1, T, K), dtype=torch.float32, device=dev),
                   torch.zeros((R + 1, T, K), dtype=torch.long, device=dev)) if K else None
        lengths = torch.full((R + 1,), T, dtype=torch.long, device=dev)
        finished = torch.zeros(R + 1, dtype=torch.bool, device=dev)
        finished[R] = True
        start = torch.zeros(R + 1, dtype=torch.long, device=dev)  # the step at which each row drew its first token
        eos = None if params.ignore_eos else torch.tensor(sorted(self.setup.eos_ids), dtype=torch.long, device=dev)
        u_all = torch.rand((T, R + 1), generator=self.gen, device=dev)  # row r draws u_all[k, r] for its token k
        forced = None if eos is None else forced_eos(params, R, dev)  # benchmarks: EOS at recorded lengths
        cap_rows = torch.tensor([c for c in caps for _ in range(G)] + [T], dtype=torch.long, device=dev)
        checks = eos is not None or queued or stop is not None  # the host reads which rows finished (else every row
        # runs T tokens)
        flags = torch.empty(R + 1, dtype=torch.bool, pin_memory=dev.type == "cuda")
        event = torch.cuda.Event() if dev.type == "cuda" else None
        pending = False

        def record(rws: torch.Tensor, k: torch.Tensor, tok, lp, top) -> torch.Tensor:
            """Token ``k`` of rows ``rws``: stored (a finished row's in the spare row R), EOS and the cap end rows."""
            done = finished[rws]
            dst = torch.where(done, R, rws)
            if forced is not None:
                tok = torch.where(forced[rws] == k + 1, eos[0], tok)
            out_tok[dst, k] = tok
            out_lp[dst, k] = lp
            if out_top is not None:
                out_top[0][dst, k], out_top[1][dst, k] = top
            if checks:
                end = k == cap_rows[rws] - 1
                now = (end if eos is None else (torch.isin(tok, eos) | end)) & ~done
                lengths[rws] = torch.where(now, k + 1, lengths[rws])
                finished[rws] = done | now
            return tok

        # slots: slot b decodes row rows_h[b] (R: none), whose columns run from entry[b] to the column c the next
        # step writes; rows enter in order, next_row the first still waiting
        c, cap = Lp, kpos_all.shape[1]
        cols = torch.arange(cap, device=dev)
        rows_h, entry, next_row, began = [R] * Rb, [0] * Rb, 0, [-1] * R  # began: the step of a row's first token
        tok = torch.full((Rb,), pad, dtype=torch.long, device=dev)
        nxt = torch.zeros(Rb, dtype=torch.long, device=dev)
        kpos_all[:Rb] = -1

        def admit(free: list[int], t: int) -> None:
            """The next waiting rows into slots ``free`` at step t: their prompts' KV into columns [c - Lp, c),
            their first token drawn from the prompt's logits."""
            nonlocal next_row, tok, nxt, rows, last
            take = list(range(next_row, min(R, next_row + len(free))))
            free = free[: len(take)]
            b, r, src = (torch.tensor(x, device=dev) for x in (free, take, [first_of[q // G] for q in take]))
            for i in range(s.layers):
                if (span := columns(s, i, Lp)) is None:
                    continue
                span = slice(c - Lp, c) if span.stop is not None else span  # a DeltaNet layer: its whole state
                k_all[i][b, :, span] = pk[i][src]
                v_all[i][b, :, span] = pv[i][src]
            kpos_all[b] = -1
            kpos_all[b, c - Lp: c] = pkpos[src]
            start[r] = t
            first, lp0, *top0 = sample(first_logits[src], u_all[0, r], *sampling)
            tok = tok.index_copy(0, b, record(r, torch.zeros_like(r), first, lp0, top0))
            nxt = nxt.index_copy(0, b, pos[src, -1] + 1)
            for slot, row in zip(free, take):
                rows_h[slot], entry[slot], began[row] = row, c - Lp, t
                last = max(last, t + caps[row // G] - 1)
            rows = torch.tensor(rows_h, device=dev)
            next_row += len(take)

        def fetch(rws: list[int]) -> list[list[int]]:
            """Finished rows' tokens, for ``stop`` (a finished row writes no more into its own row)."""
            idx = torch.tensor(rws, dtype=torch.long, device=dev)
            return [row[:m] for row, m in zip(out_tok[idx].tolist(), lengths[idx].tolist())]

        def shift() -> None:
            """The buffers' last column is reached: every slot's columns move left by the oldest live row's entry
            (a slot whose row has run past its cap has finished; its columns may be cut)."""
            nonlocal c
            alive = [e for e, r in zip(entry, rows_h) if r < R and c - e < Lp + T]
            d = min(alive + [c - Lp])
            for i in range(s.layers):
                if (span := columns(s, i, c)) is None or span.stop is None:
                    continue
                k_all[i][:Rb, :, : c - d] = k_all[i][:Rb, :, d:c].clone()
                v_all[i][:Rb, :, : c - d] = v_all[i][:Rb, :, d:c].clone()
            kpos_all[:Rb, : c - d] = kpos_all[:Rb, d:c].clone()
            kpos_all[:Rb, c - d:] = -1
            entry[:] = [e - d for e in entry]
            c -= d
            self.metrics["rollout/shifts"] = self.metrics.get("rollout/shifts", 0.0) + 1

        rows = torch.tensor(rows_h, device=dev)
        last, t, steps, slot_steps, cut = 0, 0, 0, 0, False
        admit(list(range(min(R, Rb))), 0)
        k_rows, v_rows = [k[:Rb] for k in k_all], [v[:Rb] for v in v_all]  # each layer's rows of the bucket
        while True:
            if t:
                if c == cap:
                    shift()
                length = min(cap, round_up(c + 1, self.length_bucket or cap))
                k = (t - start[rows]).clamp_(max=T - 1)
                tok, lp, *top = self._run_step(w, tok, nxt, cols[c: c + 1], u_all[k, rows], k_rows, v_rows,
                                               kpos_all[:Rb], length, sampling)
                tok = record(rows, k, tok, lp, top)
                nxt, c = nxt + 1, c + 1
                steps, slot_steps = steps + 1, slot_steps + pool  # a step reads every weight for all its slots
            if pending:  # the flags copied one step ago: waited for only now that this step is queued
                if event is not None:
                    event.synchronize()
                pending = False
                done = flags.tolist()
                if stop is not None and stop([r for r in range(R) if done[r]], fetch):
                    cut = True
                    break
                free = [b for b, r in enumerate(rows_h) if done[r]]
                if next_row < R and free:
                    admit(free, t)
                live = [b for b, r in enumerate(rows_h) if not done[r]]
                if not live and next_row == R:
                    break
                if next_row == R and rows_bucket(len(live)) < Rb:  # compaction: into a smaller bucket
                    self.metrics["rollout/compactions"] = self.metrics.get("rollout/compactions", 0.0) + 1
                    Rb, spare = rows_bucket(len(live)), rows_bucket(len(live)) - len(live)
                    rows_h, entry = [rows_h[b] for b in live] + [R] * spare, [entry[b] for b in live] + [c] * spare
                    rows = torch.tensor(rows_h, device=dev)
                    idx = torch.tensor(live, device=dev)
                    for i in range(s.layers):
                        if (span := columns(s, i, c)) is None:
                            continue
                        k_all[i][: len(live), :, span] = k_all[i][idx, :, span]
                        v_all[i][: len(live), :, span] = v_all[i][idx, :, span]
                    k_rows, v_rows = [k[:Rb] for k in k_all], [v[:Rb] for v in v_all]
                    kpos_all[: len(live), :c] = kpos_all[idx, :c]
                    kpos_all[len(live): Rb] = -1
                    tok = torch.cat([tok[idx], tok.new_full((spare,), pad)])
                    nxt = torch.cat([nxt[idx], nxt.new_zeros(spare)])
            if checks and (t + 1) % self.check_every == 0:
                flags.copy_(finished, non_blocking=True)
                if event is not None:
                    event.record()
                pending = True
            t += 1
            if t > last and next_row == R:
                break
        lengths_l, toks, lps = lengths[:R].tolist(), out_tok[:R].tolist(), out_lp[:R].tolist()
        stopped = None
        if cut:  # the rows still decoding: their tokens so far (t - began + 1); rows never started: none
            stopped = [not f for f in finished[:R].tolist()]
            lengths_l = [(t - b0 + 1 if b0 >= 0 else 0) if st else m for st, b0, m in zip(stopped, began, lengths_l)]
        self.decoded.add(sum(lengths_l) - R, slot_steps, steps)  # the first tokens came from the prefill
        tokens = [row[:m] for row, m in zip(toks, lengths_l)]
        eos_set = set(self.setup.eos_ids)
        truncated = torch.tensor([not (tk and tk[-1] in eos_set) for tk in tokens], dtype=torch.bool)
        if stopped is not None:
            truncated &= ~torch.tensor(stopped)
        out = Completions(tokens=tokens, truncated=truncated, logprobs=[row[:m] for row, m in zip(lps, lengths_l)],
                          stopped=None if stopped is None else torch.tensor(stopped))
        if out_top is not None:  # zeros past each row's end
            past = (torch.arange(T, device=dev).unsqueeze(0) >= lengths[:R].unsqueeze(1)).unsqueeze(-1)
            out.topk_logprobs = out_top[0][:R].masked_fill(past, 0.0).cpu()
            out.topk_ids = out_top[1][:R].masked_fill(past, 0).cpu()
        return out
