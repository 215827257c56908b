"""The rollout service: the one door to generation, used by the trainer, evaluation and algorithms.

    generate(prompts, params, n)           n completions per prompt (ids, truncation, sampler log-probs)
    continue_sequences(prompts, prefixes)  extend partial completions (guided correction; multi-turn)
    rollout(prompts, items, index)         the step's groups as a scored RolloutBatch
    rollout_stream(stream, version, items) a streamed step's whole groups (grpo/rollout/stream.py), scored (a group
                                           whole mid-call on a thread of its own, while the others decode)
    score(batch)                           the reward functions on a batch's texts
    sync_weights()                         after every optimizer step (a no-op for the ``hf`` engine)
    offload()                              before the training passes (vllm on CUDA: the engine sleeps)
    pop_metrics()                          the engine's own metrics (vllm: sync time, probe gap)

Behind it sits a :class:`~grpo.rollout.engine.GenerationEngine` chosen by ``rollout.engine``.
ZeRO-3's collective generation is handled here and in the engine, nowhere else: callers make
the same calls on every rank (``collective_rounds`` says how many when their work is uneven).
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from grpo.foundation.console import say
from grpo.foundation import dist
from grpo.foundation.batch import RolloutBatch
from grpo.foundation.config import ConfigError
from grpo.foundation.plugins import Scorer
from grpo.foundation.registry import Registry
from grpo.rollout.engine import Completions, EngineSetup, GenerationEngine, SamplingParams, completion_mask, cut_at_eos
from grpo.rollout.hf import HFEngine, needs_synced_generation
from grpo.rollout.static import StaticEngine, unsupported_reason
from grpo.rollout.stream import Group, Stream


def auto_engine(setup: EngineSetup) -> GenerationEngine:
    """``rollout.engine: auto``: the static engine on CUDA for the models it supports, hf otherwise (the choice
    and its reason printed once, at build, by the main rank)."""
    device = next(setup.model.parameters()).device
    reason = ("the policy is not on CUDA" if device.type != "cuda" else
              "rollout.carried_kv=keep: the hf engine keeps carried rows' caches" if setup.cfg.rollout.carried_kv == "keep"
              else unsupported_reason(setup.model))
    if dist.is_main():
        say(f"rollout.engine=auto: {'static (CUDA, a supported model)' if reason is None else f'hf ({reason})'}")
    return StaticEngine(setup) if reason is None else HFEngine(setup)


def _engine_protocol(cls: Any, key: str, name: str) -> None:
    """A ``package.module:Class`` engine implements the protocol (the registered ones do)."""
    missing = [m for m in ("generate", "sync_weights") if ":" in name and not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{key}={name!r} lacks {missing}: an engine implements "
                          "grpo.rollout.engine.GenerationEngine (generate, sync_weights)")


# name -> engine class (or a function of the EngineSetup that builds one); ``rollout.engine`` may also be any
# ``package.module:Class``
ENGINES = Registry("generation engine", "rollout.engine", paths="Class", check=_engine_protocol)
for _name, _engine in {"auto": "grpo.rollout.service:auto_engine", "hf": "grpo.rollout.hf:HFEngine",
                       "static": "grpo.rollout.static:StaticEngine",
                       "vllm": "grpo.rollout.vllm_engine:VLLMEngine"}.items():  # imported at first use
    ENGINES.register(_name, _engine)


def engine_class(name: str) -> Callable[[EngineSetup], GenerationEngine]:
    """The engine class that ``rollout.engine`` names (a registered name or ``package.module:Class``), its
    optional dependencies checked."""
    cls = ENGINES.get(name)
    getattr(cls, "check_installed", lambda: None)()  # its optional dependencies (a ConfigError naming the extra)
    return cls


def decode_completions(tokenizer, tokens: list[list[int]], eos_ids: list[int]) -> list[str]:
    """Text the rewards see: everything the model wrote except the final EOS (special tokens stay
    visible, so a policy cannot hide filler in tokens that decoding would skip)."""
    eos = set(eos_ids)
    return tokenizer.batch_decode([t[:-1] if t and t[-1] in eos else t for t in tokens])


class RolloutService:
    def __init__(self, setup: EngineSetup, scorer: Optional[Scorer] = None,
                 engine: Optional[GenerationEngine] = None):
        self.setup, self.scorer = setup, scorer
        self.cfg = setup.cfg.rollout
        self.engine = engine if engine is not None else engine_class(self.cfg.engine)(setup)
        self.timings: dict[str, float] = {}
        # called with each single-turn step's batch once generated, before its rewards (the trainer's early
        # reference request); None: nothing
        self.on_generated: Optional[Callable[[RolloutBatch], None]] = None
        # a streamed call's group just whole (its prompt, its rows' tokens), while the other rows decode: e.g. the
        # trainer's reference request for it
        self.on_group: Optional[Callable[[list[int], list[list[int]]], None]] = None
        # the audit's steps (grpo/training/audit.py): the engine's top-k of each drawn token's distribution, into
        # batch.extra["sampler_topk_logp" / "sampler_topk_ids"]; 0: not asked
        self.audit_top_k = 0
        # a streamed step: (its stream, the weights version, the groups handed out so far, refills included), whose
        # figures pop_metrics gives
        self._streamed: Optional[tuple[Stream, int, list[Group]]] = None
        # a streamed run's groups scored as they become whole, while the other rows decode: one thread, so that the
        # reward sources see one call at a time (their workers run the calls' rows in parallel)
        self._ahead: Optional[ThreadPoolExecutor] = None

    @classmethod
    def build(cls, cfg, model: torch.nn.Module, tokenizer, eos_ids: list[int],
              scorer: Optional[Scorer] = None,
              make_engine: Optional[Callable[[EngineSetup], GenerationEngine]] = None) -> "RolloutService":
        """``make_engine``: the engine class (default: the one ``rollout.engine`` names)."""
        setup = EngineSetup(cfg=cfg, model=model, tokenizer=tokenizer, eos_ids=list(eos_ids),
                            pad_id=tokenizer.pad_token_id, synced=needs_synced_generation(cfg.train.zero_stage))
        return cls(setup, scorer, make_engine(setup) if make_engine is not None else None)

    @property
    def tokenizer(self):
        return self.setup.tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return self.setup.eos_ids

    @property
    def params(self) -> SamplingParams:
        """The rollout's sampling settings."""
        return SamplingParams.from_rollout(self.cfg)

    def _time(self, name: str, t0: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    def pop_timings(self) -> dict[str, float]:
        """The phases' seconds since the last call, the engine's own split of the generation among them (the static
        and hf engines': ``generation_prefill``, ``generation_decode``)."""
        pop = getattr(self.engine, "pop_timings", None)
        out, self.timings = {**self.timings, **(pop() if pop is not None else {})}, {}
        return out

    # ----------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: Optional[SamplingParams] = None,
                 n: Optional[int] = None) -> Completions:
        """``n`` (default G) completions per prompt. Collective under ZeRO-3: call it on every rank."""
        if not prompts and not self.setup.synced:
            return Completions.empty()
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params or self.params, self.cfg.num_generations if n is None else n)
        self._time("generation", t0)
        return out

    def continue_sequences(self, prompts: list[list[int]], prefixes: list[list[int]],
                           room: list[int]) -> list[tuple[list[int], bool]]:
        """Continue ``prompts[i] + prefixes[i]`` by at most ``room[i]`` tokens (one sample each, the
        rollout's sampling settings); returns (new tokens up to and including EOS, truncated).
        Collective under ZeRO-3 like ``generate`` (call it on every rank, with or without rows)."""
        budget = max(room, default=0)
        comp = self.generate([p + x for p, x in zip(prompts, prefixes)],
                             dataclasses.replace(self.params, max_tokens=budget), n=1)
        eos = set(self.setup.eos_ids)
        return [cut_at_eos(toks, eos, r) for toks, r in zip(comp.tokens, room)]

    def collective_rounds(self, n: int) -> int:
        """How many generation calls this rank must make when it has work for ``n``: under ZeRO-3 every
        rank makes as many as the busiest one (the extra ones with no prompts)."""
        if not self.setup.synced:
            return n
        return int(dist.all_reduce_max(torch.tensor([float(n)], dtype=torch.float64))[0])

    def sync_weights(self) -> None:
        t0 = time.perf_counter()
        self.engine.sync_weights()
        self._time("weight_sync", t0)

    def offload(self) -> None:
        """The training passes come next: an engine that holds memory of its own may release it."""
        release = getattr(self.engine, "offload", None)
        if release is not None:
            release()

    def close(self) -> None:
        """The engine lets go of what it holds beyond this process's lifetime rules (idempotent)."""
        if self._ahead is not None:
            self._ahead.shutdown()
            self._ahead = None
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def pop_metrics(self) -> dict[str, float]:
        """The engine's own metrics since the last call (hf: prefix reuse in multi-turn runs; vllm: syncs, probe)."""
        pop = getattr(self.engine, "pop_metrics", None)
        out = pop() if pop is not None else {}
        if self._streamed is not None:
            stream, version, taken = self._streamed
            out.update(stream.pop_metrics(taken, version))
            self._streamed = None
        return out

    # ----------------------------------------------------------------- text and rewards
    def decode(self, tokens: list[list[int]]) -> list[str]:
        return decode_completions(self.setup.tokenizer, tokens, self.setup.eos_ids)

    def rollout(self, prompts: list[list[int]], items: list[dict[str, Any]], prompt_index: list[int],
                n: Optional[int] = None) -> RolloutBatch:
        """G completions for each prompt, scored: the rows of one step (group-major)."""
        G = self.cfg.num_generations if n is None else n
        comp = self.generate(prompts, dataclasses.replace(self.params, topk_logprobs=self.audit_top_k), n=G)
        return self._scored(prompts, items, prompt_index, G, comp)

    def rollout_stream(self, stream: Stream, version: int, items: Callable[[Any], dict[str, Any]],
                       need: Optional[int] = None) -> RolloutBatch:
        """A streamed step (``rollout.max_staleness`` >= 1): ``stream``'s whole groups for weights ``version`` (``need``
        of them: a refill's count), scored (``items``: a group's dataset row from its item); the stream's figures
        join ``pop_metrics``, a refill's added to the step's.

        A group that becomes whole in the middle of an engine call (the built-in engines say so at their host reads)
        is scored at once on another thread, while the other rows decode: its reward sources are called with its G
        rows; the groups still whole at the call's end are scored together as before. Every such call has ended when
        this returns (``time/reward`` counts the wait)."""
        t0 = time.perf_counter()
        if self.scorer is not None and self._ahead is None:
            self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards-ahead")

        def whole(g: Group, tokens: list[list[int]]) -> Optional[Future]:
            if self.on_group is not None:
                self.on_group(g.prompt, tokens)
            return None if self.scorer is None else self._ahead.submit(self._group_values, g, items(g.item), tokens)

        if self.scorer is not None or self.on_group is not None:
            stream.on_whole = whole
        try:
            groups = stream.next(version, need)
        finally:
            stream.on_whole = None
        self._time("generation", t0)
        t1 = time.perf_counter()
        for g in groups + stream.pending:  # a reward error raises here, in the trainer's thread
            if isinstance(g.ahead, Future):
                g.ahead.result()
        self._time("reward", t1)
        same_step = self._streamed is not None and self._streamed[:2] == (stream, version)
        earlier = self._streamed[2] if same_step else []
        self._streamed = (stream, version, earlier + groups)  # a refill within the step adds to the step's groups
        return self.rollout_groups(groups, [items(g.item) for g in groups], version)

    def rollout_groups(self, groups: list[Group], items: list[dict[str, Any]], version: int = 0) -> RolloutBatch:
        """A streamed step's whole groups (grpo/rollout/stream.py; each group's ``item`` its dataset index, ``items``
        their dataset rows) as a scored RolloutBatch, the sampler's log-probs (and the audit's top-k) those each
        token was drawn with; ``extra["versions_behind"]``: each token's weights, in steps before ``version``."""
        rows = [r for g in groups for r in g.rows]
        T = self.cfg.max_completion_length
        comp = Completions(tokens=[r.tokens for r in rows], truncated=torch.tensor([r.truncated for r in rows]),
                           logprobs=[r.logprobs for r in rows])
        if rows and all(r.topk for r in rows if r.tokens):  # [R, T, k], zeros past each row's end
            k = next(r.topk[0][0].shape[-1] for r in rows if r.topk)
            comp.topk_logprobs, comp.topk_ids = torch.zeros(len(rows), T, k), torch.zeros(len(rows), T, k, dtype=torch.long)
            for i, r in enumerate(rows):
                if r.topk:
                    comp.topk_logprobs[i, : len(r.tokens)] = torch.cat([c[0] for c in r.topk])
                    comp.topk_ids[i, : len(r.tokens)] = torch.cat([c[1] for c in r.topk])
        batch = self._scored([g.prompt for g in groups], items, [g.item for g in groups], self.cfg.num_generations,
                             comp, ahead=[g.ahead for g in groups])
        behind = torch.zeros(len(rows), batch.width, dtype=torch.long)
        for i, r in enumerate(rows):
            behind[i, : len(r.versions)] = version - torch.tensor(r.versions, dtype=torch.long)
        batch.extra = {**batch.extra, "versions_behind": behind}
        return batch

    def _group_values(self, g: Group, item: dict[str, Any], tokens: list[list[int]]) -> tuple[list[float], dict]:
        """A whole group's rewards (the scorer's (total, per source) of its rows), scored ahead of its step."""
        comp = Completions(tokens=tokens, truncated=torch.zeros(len(tokens), dtype=torch.bool))
        return self._values(self._batch([g.prompt], [item], [g.item], len(tokens), comp))

    def _scored(self, prompts: list[list[int]], items: list[dict[str, Any]], prompt_index: list[int], G: int,
                comp: Completions, ahead: Optional[list[Any]] = None) -> RolloutBatch:
        """The batch of G completions per prompt (group-major), handed to ``on_generated``, then scored (``ahead``:
        per prompt, its rows' scores already computed, a done Future, or None)."""
        batch = self._batch(prompts, items, prompt_index, G, comp)
        if self.on_generated is not None:  # e.g. the trainer's reference request, in flight while rewards run
            self.on_generated(batch)
        if self.scorer is not None and any(a is not None for a in ahead or []):
            self.score(batch, ahead)
        elif self.scorer is not None:  # none: a run whose algorithm learns from no reward (opd, rewards: [])
            self.score(batch)
        return batch

    def _batch(self, prompts: list[list[int]], items: list[dict[str, Any]], prompt_index: list[int], G: int,
               comp: Completions) -> RolloutBatch:
        """The RolloutBatch of G completions per prompt (group-major), unscored."""
        rows = [i for i in range(len(prompts)) for _ in range(G)]
        prompt_ids = [prompts[i] for i in rows]
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            completion_ids=comp.tokens,
            mask=comp.mask(self.cfg.max_completion_length),
            truncated=comp.truncated,
            group_size=G,
            prompt_index=[prompt_index[i] for i in rows],
            items=[items[i] for i in rows],
            prompt_text=self.setup.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False),
            completion_text=self.decode(comp.tokens),
        )
        if comp.logprobs is not None:
            batch.sampler_logp = completion_logp_tensor(comp.logprobs, batch.width)
        if comp.topk_logprobs is not None:  # [R, max_tokens, k] -> the batch's width
            width = batch.width
            batch.extra = {**batch.extra, "sampler_topk_logp": comp.topk_logprobs[:, :width].float(),
                           "sampler_topk_ids": comp.topk_ids[:, :width].long()}
        return batch

    def _values(self, batch: RolloutBatch) -> tuple[list[float], dict[str, list[float]]]:
        """The scorer on a batch's texts and columns: (total per row, {source: values})."""
        return self.scorer(batch.prompt_text, batch.completion_text, batch.columns(),
                           raw_prompts=[it.get("prompt") for it in batch.items],
                           completion_ids=[list(c) for c in batch.completion_ids])

    def score(self, batch: RolloutBatch, ahead: Optional[list[Any]] = None) -> None:
        """Set ``batch.rewards`` and ``batch.reward_terms`` from the reward functions (texts and columns). ``ahead``:
        per group, its rows' scores computed before (a done Future of (total, per source)), or None: only the other
        groups' rows are scored now."""
        if self.scorer is None:
            raise RuntimeError("this rollout service has no reward functions (built without a scorer)")
        t0 = time.perf_counter()
        G, R = batch.group_size, len(batch)
        done = {gi: a.result() for gi, a in enumerate(ahead or []) if a is not None}
        if not done:
            total, per_fn = self._values(batch)
        else:
            rest = [i for i in range(R) if i // G not in done]
            parts = [(range(gi * G, gi * G + G), v) for gi, v in done.items()]  # (the batch's rows, their scores)
            if rest:
                parts.append((rest, self._values(batch.select(rest))))
            total, per_fn = [0.0] * R, {}
            for rows, (t, p) in parts:
                for j, i in enumerate(rows):
                    total[i] = t[j]
                    for k, v in p.items():
                        per_fn.setdefault(k, [math.nan] * R)[i] = v[j]
        batch.rewards = torch.tensor(total, dtype=torch.float32)
        batch.reward_terms = {k: torch.tensor(v, dtype=torch.float32) for k, v in per_fn.items()}
        self._time("reward", t0)

    def rewrite(self, batch: RolloutBatch, rows: list[int], completions: list[tuple[list[int], bool]]) -> None:
        """Replace the completions of ``rows`` (tokens, truncated) in place, then decode and re-score them. The rows
        are marked ``extra["rewritten"]``: the engine did not draw their tokens (``RolloutBatch.sampled_mask``)."""
        if not rows:
            return
        for i, (toks, truncated) in zip(rows, completions):
            batch.completion_ids[i] = toks
            batch.truncated[i] = truncated
        batch.mask = completion_mask([len(c) for c in batch.completion_ids], batch.width)
        rewritten = batch.extra.get("rewritten", torch.zeros(len(batch))).clone()
        rewritten[torch.tensor(rows)] = 1.0
        batch.extra = {**batch.extra, "rewritten": rewritten}
        for i, t in zip(rows, self.decode([batch.completion_ids[i] for i in rows])):
            batch.completion_text[i] = t
        sub = batch.select(rows)
        self.score(sub)
        idx = torch.tensor(rows)
        batch.rewards = batch.rewards.clone()
        batch.rewards[idx] = sub.rewards
        for k, v in sub.reward_terms.items():
            batch.reward_terms[k] = batch.reward_terms[k].clone()
            batch.reward_terms[k][idx] = v


def completion_logp_tensor(logprobs: list[list[float]], width: int) -> torch.Tensor:
    """[R, width] float32 sampler log-probs, 0 past each row's end."""
    out = torch.zeros(len(logprobs), width)
    for i, row in enumerate(logprobs):
        out[i, : len(row)] = torch.tensor(row[:width], dtype=torch.float32)
    return out
