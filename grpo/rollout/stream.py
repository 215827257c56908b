"""Partial rollouts with a bound (issue 56: ``max_staleness`` K >= 1): a step's whole groups from a stream of rows
that never waits for its longest rows.

Groups are issued ahead from the data, at most (K + 1) x ``groups_per_step`` of them drawn and not yet handed out
(paced admission: a slow prompt is never dropped to make room). Each call to ``next`` decodes every unfinished row
through the engine's slots, oldest group first, each row fed as its prompt plus its tokens so far (so a row carried
over a weight update is prefilled again under the new weights), and stops as soon as ``groups_per_step`` groups are
whole and no group would fall more than K versions behind by waiting: those are the step's, oldest first. The rows
still decoding keep their tokens, each with the sampler's log-prob and the weights version that drew it, and carry
on at the next call. A step waits for a group already K versions behind rather than let it go stale (dropping it
would starve the prompts with long completions, the hard ones); a group that is still more than K versions behind
the weights it would train on (whole, but beyond the step's share) is drawn again from the start (counted), never
handed out.

The engine needs ``generate(..., room=, stop=)`` (every built-in engine's). Why prefill again by default rather than
keep the old KV (``rollout.carried_kv: keep``, the hf engine): a kept KV mixes two policies inside one row's
attention, and the prefill is one compute-bound pass over tokens the step already paid for (docs/streaming.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from grpo.rollout.engine import SamplingParams


@dataclass
class Row:
    """One completion as it grows: each token with the sampler's log-prob and the weights version that drew it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    # the audit's top-k at each token (``topk`` > 0): chunks of ([n, k] log-probs, [n, k] ids), one per call
    topk: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class Group:
    """A prompt's G rows, in issue order (``serial``)."""

    serial: int
    prompt: list[int]
    item: Any  # what the feed gave with the prompt (the dataset's row, its index)
    rows: list[Row]
    ahead: Any = None  # what the stream's ``on_whole`` returned when the group became whole mid-call (its scores)

    @property
    def whole(self) -> bool:
        return all(r.done for r in self.rows)

    def oldest(self) -> Optional[int]:
        """The oldest weights version among its tokens (None: no token yet)."""
        return min((min(r.versions) for r in self.rows if r.versions), default=None)


def can_stream(engine: Any) -> bool:
    """Whether ``engine.generate`` takes ``room`` and ``stop`` (every built-in engine's)."""
    params = inspect.signature(engine.generate).parameters
    return "room" in params and "stop" in params


class Stream:
    """``next(version)``: the step's ``groups_per_step`` whole groups (module docstring). ``feed(n)`` gives the next
    ``n`` (prompt ids, item) pairs of the data."""

    def __init__(self, engine: Any, params: SamplingParams, group_size: int, groups_per_step: int,
                 max_staleness: int, feed: Callable[[int], list[tuple[list[int], Any]]], topk: int = 0):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: a stream carries rows over at least one update (K >= 1)")
        if not can_stream(engine):
            raise ValueError(f"{type(engine).__name__} cannot stop a generation call part-way (generate(..., room=, "
                             f"stop=)), which rollout.max_staleness needs: use a built-in engine (auto, hf, static, vllm), "
                             f"or give it those arguments (grpo/rollout/stream.py)")
        self.engine, self.G = engine, group_size
        # topk: the audit's (logging.audit_top_k, when it audits): every token keeps the k most likely tokens of the
        # distribution it was drawn from, since an audited step's rows hold tokens of earlier calls
        self.params = replace(params, topk_logprobs=topk)
        self.need, self.K, self.feed = groups_per_step, max_staleness, feed
        self.pending: list[Group] = []  # issued and not handed out, oldest first
        self.serial = 0
        self.counts = {"regenerated": 0, "refed": 0}
        # (group, each row's tokens) -> Group.ahead: called when a group becomes whole in the middle of an engine call
        # (an engine that passes ``stop`` a fetch of finished rows' tokens), so that its rewards score while the other
        # rows decode (the rollout service sets it)
        self.on_whole: Optional[Callable[[Group, list[list[int]]], Any]] = None

    # -- the queue
    def _issue(self, need: int) -> None:
        """Top the queue up to (K + 1) x groups_per_step groups (and at least ``need``)."""
        want = max((self.K + 1) * self.need, need) - len(self.pending)
        for prompt, item in (self.feed(want) if want > 0 else []):
            self.pending.append(Group(self.serial, list(prompt), item, [Row() for _ in range(self.G)]))
            self.serial += 1

    def _regenerate(self, version: int) -> None:
        """Groups with a token more than K versions behind ``version`` start again."""
        for g in self.pending:
            oldest = g.oldest()
            if oldest is not None and version - oldest > self.K:
                g.rows, g.ahead = [Row() for _ in range(self.G)], None
                self.counts["regenerated"] += 1

    def _forced(self, g: Group, j: int, row: Row) -> int:
        """Benchmarks (``forced_eos_lengths``): the tokens left before row j of group g's recorded length."""
        at = self.params.forced_eos_lengths
        return at[(g.serial * self.G + j) % len(at)] - len(row.tokens)

    # -- a step
    def next(self, version: int, need: Optional[int] = None) -> list[Group]:
        """The step's whole groups (``groups_per_step`` of them, or ``need``: a refill such as dapo's dynamic
        sampling; fewer only when the feed ran dry), every token at most K versions behind ``version``, the weights
        they train on."""
        need = self.need if need is None else need
        self._issue(need)
        self._regenerate(version)
        while not self._ready(version, need)({}) and not all(g.whole for g in self.pending):
            self._decode(version, need)
        whole = [g for g in self.pending if g.whole][: need]
        taken = {id(g) for g in whole}
        self.pending = [g for g in self.pending if id(g) not in taken]
        return whole

    def _ready(self, version: int, need: int) -> Callable[[dict[int, int]], bool]:
        """Whether the step can end, given the rows of each group (by id) finished in the call under way: ``need``
        groups whole, and every group K versions behind whole. The groups are read once here, not at every host
        read of the call."""
        left = {id(g): sum(not r.done for r in g.rows) for g in self.pending}
        behind = [id(g) for g in self.pending if (o := g.oldest()) is not None and version - o >= self.K]

        def ready(ended: dict[int, int]) -> bool:
            whole = {gid for gid, n in left.items() if n == ended.get(gid, 0)}
            return len(whole) >= need and all(gid in whole for gid in behind)

        return ready

    def _decode(self, version: int, need: int) -> None:
        """One engine call over every unfinished row, stopped once enough groups are whole."""
        calls = [(g, j, r) for g in self.pending for j, r in enumerate(g.rows) if not r.done]
        T = self.params.max_tokens
        params = self.params
        if params.forced_eos_lengths:
            params = replace(params, forced_eos_lengths=tuple(self._forced(g, j, r) for g, j, r in calls))
        group_of = [id(g) for g, _, _ in calls]
        ready = self._ready(version, need)
        left = {id(g): sum(not r.done for r in g.rows) for g in self.pending}
        by_id = {id(g): g for g in self.pending}
        told: set[int] = set()  # groups handed to on_whole during this call

        def stop(finished: list[int], fetch: Optional[Callable[[list[int]], list[list[int]]]] = None) -> bool:
            """``finished``: the call's rows finished so far; ``fetch`` (optional): their tokens, by row."""
            ended: dict[int, int] = {}
            for i in finished:
                ended[group_of[i]] = ended.get(group_of[i], 0) + 1
            if self.on_whole is not None and fetch is not None:
                now = {gid for gid, n in ended.items() if n == left[gid] and gid not in told}
                if now:
                    rows = [i for i in finished if group_of[i] in now]
                    tokens = {id(calls[i][2]): calls[i][2].tokens + t for i, t in zip(rows, fetch(rows))}
                    for gid in now:
                        g = by_id[gid]
                        g.ahead = self.on_whole(g, [tokens.get(id(r), r.tokens) for r in g.rows])
                    told.update(now)
            return ready(ended)

        self.counts["refed"] += sum(len(r.tokens) for _, _, r in calls)  # carried tokens fed again as prompt
        out = self.engine.generate([g.prompt + r.tokens for g, _, r in calls], params, 1,
                                   room=[T - len(r.tokens) for _, _, r in calls], stop=stop)
        stopped = out.stopped.tolist() if out.stopped is not None else [False] * len(calls)
        for i, (g, j, r) in enumerate(calls):
            r.tokens += out.tokens[i]
            r.logprobs += out.logprobs[i]
            r.versions += [version] * len(out.tokens[i])
            if out.topk_logprobs is not None:
                n = len(out.tokens[i])
                r.topk.append((out.topk_logprobs[i, :n], out.topk_ids[i, :n]))
            if not stopped[i]:
                r.done, r.truncated = True, bool(out.truncated[i])

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the items of the groups issued and not handed out, in issue order (a resumed
        run draws them again from their prompts, first)."""
        return {"pending": [g.item for g in self.pending]}

    def requeue(self, pairs: list[tuple[list[int], Any]]) -> None:
        """Groups issued before a resume, (prompt ids, item) in issue order: drawn again, before any new group."""
        groups = []
        for prompt, item in pairs:
            groups.append(Group(self.serial, list(prompt), item, [Row() for _ in range(self.G)]))
            self.serial += 1
        self.pending = groups + self.pending

    def pop_metrics(self, taken: list[Group], version: int) -> dict[str, float]:
        """The step's streaming figures: token-weighted staleness of ``taken`` (versions behind ``version``), the
        rows carried to the next step, the groups drawn again and the carried tokens fed again (prefilled under the
        new weights) since the last call."""
        behind = [version - v for g in taken for r in g.rows for v in r.versions]
        out = {"rollout/staleness_mean": sum(behind) / max(1, len(behind)),
               "rollout/staleness_max": float(max(behind, default=0)),
               "rollout/carried_rows": float(sum(bool(r.tokens) and not r.done for g in self.pending for r in g.rows)),
               "rollout/regenerated": float(self.counts["regenerated"]), "rollout/refed_tokens": float(self.counts["refed"])}
        self.counts["regenerated"] = self.counts["refed"] = 0
        return out
