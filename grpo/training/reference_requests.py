"""The reference server's requests of a step, asked as early as the rows exist and answered per group.

A server computes while the trainer does something else: a step's groups are asked right after generation (the
rollout service's ``on_generated``, while the rewards, the algorithm's batch changes and the old log-probs run; once a
step: an algorithm's extra generations, a refill or a greedy baseline, are not sent then), and
in a streamed step (``rollout.max_staleness`` >= 1) each group as soon as it is whole, while the other rows still
decode (``on_group``). The step's batch then takes each group's answer from the request that asked it; a group the
algorithm changed or added since (a filter, a refill) is asked then, and ``ref/early_request`` says the share of the
batch's rows answered early. An answer is used only under the reference weights it was asked of (a reference sync
drops the rest).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

import torch

from grpo.foundation.batch import RolloutBatch
from grpo.foundation.logprobs import pack

Key = tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]


def _key(prompt: list[int], completions: list[list[int]]) -> Key:
    return tuple(prompt), tuple(tuple(c) for c in completions)


class Joined:
    """A batch's reference log-probs [rows, width] from the requests that asked its groups: ``parts`` are (the
    group's first row in the batch, its rows, the request, the group's first row in the request)."""

    def __init__(self, parts: list[tuple[int, int, Future, int]], rows: int, width: int):
        self.parts, self.rows, self.width = parts, rows, width

    def result(self) -> torch.Tensor:
        out = None
        for at, n, future, first in self.parts:
            got = future.result()[first: first + n]
            if out is None:
                out = got.new_zeros((self.rows, self.width))
            w = min(self.width, got.shape[1])
            out[at: at + n, :w] = got[:, :w]
        return out if out is not None else torch.zeros(self.rows, self.width)


class ReferenceRequests:
    """A remote reference's requests (grpo.reference.handle: ``submit``, ``version``), remembered per group of G
    rows; ``keep_steps``: how many steps after its own an unused answer is kept (``rollout.max_staleness``: a
    streamed group whole before its step; 0: dropped at its step's end)."""

    def __init__(self, reference: Any, group_size: int, pad_id: int, temperature: float, width: int,
                 keep_steps: int = 0):
        self.reference, self.G, self.pad_id, self.temperature = reference, group_size, pad_id, temperature
        self.width, self.keep_steps = width, keep_steps
        self.asked: dict[Key, tuple[Future, int, int, int]] = {}  # group -> (request, first row, version, step)
        self.step = 0  # the batches answered so far (one a step)
        self.early_step = -1  # the step whose first generated rows were asked

    def _ask(self, prompts: list[list[int]], completions: list[list[int]], width: int) -> None:
        """One request for these rows (whole groups, group-major), remembered per group."""
        future = self.reference.submit(pack(prompts, completions, self.pad_id, width), self.temperature)
        for j in range(0, len(completions), self.G):
            self.asked[_key(prompts[j], completions[j: j + self.G])] = (future, j, self.reference.version, self.step)

    def group(self, prompt: list[int], completions: list[list[int]]) -> None:
        """A group just became whole (the rollout service's ``on_group``, a streamed call): ask for it now."""
        if _key(prompt, completions) not in self.asked:
            self._ask([prompt] * len(completions), completions, self.width)

    def early(self, batch: RolloutBatch) -> None:
        """Rows just generated (the rollout service's ``on_generated``): the groups not asked yet, in one request;
        only the step's first generated rows."""
        if self.early_step == self.step:
            return
        self.early_step = self.step
        rows = self._unasked(batch)
        if rows:
            self._ask([batch.prompt_ids[i] for i in rows], [batch.completion_ids[i] for i in rows], batch.width)

    def _unasked(self, batch: RolloutBatch) -> list[int]:
        version = self.reference.version
        rows = []
        for s in range(0, len(batch), self.G):
            hit = self.asked.get(_key(batch.prompt_ids[s], batch.completion_ids[s: s + self.G]))
            if hit is None or hit[2] != version:
                rows.extend(range(s, min(s + self.G, len(batch))))
        return rows

    def request(self, batch: RolloutBatch, metrics: Optional[dict[str, float]] = None) -> Joined:
        """The batch's reference log-probs, from the requests that asked its groups; the groups not asked (or asked
        of other reference weights) are asked now. ``metrics["ref/early_request"]``: the share of rows answered by
        a request sent before this call."""
        missing = self._unasked(batch)
        if metrics is not None:
            metrics["ref/early_request"] = 1.0 - len(missing) / max(1, len(batch))
        if missing:
            self._ask([batch.prompt_ids[i] for i in missing], [batch.completion_ids[i] for i in missing], batch.width)
        parts, used = [], set()
        for s in range(0, len(batch), self.G):
            key = _key(batch.prompt_ids[s], batch.completion_ids[s: s + self.G])  # (two equal groups: one answer)
            future, first, _, _ = self.asked[key]
            parts.append((s, min(self.G, len(batch) - s), future, first))
            used.add(key)
        self.step += 1
        self.asked = {k: v for k, v in self.asked.items()  # taken, or kept past keep_steps: dropped
                      if k not in used and v[2] == self.reference.version and self.step - v[3] <= self.keep_steps}
        return Joined(parts, len(batch), batch.width)
