"""What a reference is, wherever it runs: the :class:`Reference` protocol that grpo/reference/handle.py wraps for
the trainer and the algorithms, its error, and the one sliced forward pass that the in-process reference
(in_process.py) and the reference server (server/worker.py) both run, so that the same rows give bit-identical
log-probs on either side. The server's client is in http.py.

``submit`` starts the work and returns a future whose ``result()`` gives [rows, width] log-probs, so a remote
request can run while the trainer scores rewards and computes old log-probs. ``submit_topk`` also asks for the
``top_k`` most likely next tokens at every completion position (their log-probs and ids, [rows, width, top_k];
at most grpo.foundation.config.MAX_TOP_K, 64): the support of a teacher's exact top-k divergence, and of the audit's.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional, Protocol

import torch

from grpo.foundation import dist
from grpo.foundation.logprobs import Packed, Scores, completion_scores


class ReferenceServerError(RuntimeError):
    """The reference cannot answer (e.g. the server is gone); the message says what to do."""


def row_slices(rows: int, row_tokens: int, max_rows: Optional[int] = None, max_tokens: Optional[int] = None) -> list[slice]:
    """Consecutive row slices of at most ``max_rows`` rows and ``max_tokens`` padded tokens (>= 1 row each)."""
    per = rows if max_rows is None else max_rows
    if max_tokens is not None:
        per = min(per, max(1, max_tokens // max(1, row_tokens)))
    per = max(1, per)
    return [slice(s, s + per) for s in range(0, rows, per)]


@torch.no_grad()
def sliced_scores(
    model: torch.nn.Module,
    packed: Packed,
    temperature: float,
    chunk_size: int,
    max_rows: Optional[int] = None,
    max_tokens: Optional[int] = None,
    with_entropy: bool = False,
    synced: bool = False,
    top_k: int = 0,
) -> Scores:
    """[rows, width] float32 CPU log-probs of ``packed`` (and entropy; and the top-k next tokens at each completion
    position, ``top_k``), one forward pass per row slice.

    The in-process reference and the reference server both call this, so the same rows in the
    same slices give bit-identical results whichever side computes them. ``synced`` (a model
    partitioned under ZeRO-3, whose weights are gathered inside every forward): every rank runs
    as many forward passes as the busiest one, each the same sequence of module calls.
    """
    parts: list[Scores] = []
    slices = row_slices(packed.input_ids.shape[0], packed.input_ids.shape[1], max_rows, max_tokens)
    if synced:
        extra = int(dist.all_reduce_max(torch.tensor([float(len(slices))], dtype=torch.float64))[0]) - len(slices)
        idle = Packed(torch.zeros((1, 2), dtype=torch.long), torch.ones((1, 2), dtype=torch.long),
                      torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1)
        for _ in range(extra):  # a rank with fewer rows joins the others' weight gathers
            completion_scores(model, idle, temperature, chunk_size, share_prefix=False, top_k=top_k)
    for sl in slices:
        part = Packed(packed.input_ids[sl], packed.attention_mask[sl], packed.start[sl], packed.length[sl], packed.width)
        parts.append(completion_scores(model, part, temperature, chunk_size, with_entropy, share_prefix=not synced,
                                       top_k=top_k))

    def joined(name: str, cast: bool = True) -> Optional[torch.Tensor]:
        # on the device until here: one copy to the host at the end, not one wait per slice
        values = [getattr(p, name) for p in parts]
        if values[0] is None:
            return None
        return torch.cat([v.float() if cast else v for v in values]).cpu()

    return Scores(joined("logprobs"), joined("entropy"), topk_logprobs=joined("topk_logprobs"),
                  topk_ids=joined("topk_ids", cast=False))


def sliced_logprobs(model: torch.nn.Module, packed: Packed, temperature: float, chunk_size: int,
                    max_rows: Optional[int] = None, max_tokens: Optional[int] = None, with_entropy: bool = False,
                    synced: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`sliced_scores`' log-probs and entropy (None unless ``with_entropy``)."""
    s = sliced_scores(model, packed, temperature, chunk_size, max_rows, max_tokens, with_entropy, synced)
    return s.logprobs, s.entropy


class Reference(Protocol):
    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]": ...
    def submit_topk(self, packed: Packed, temperature: float, top_k: int) -> "Future[Scores]": ...
    def info(self) -> dict: ...
    def reload(self, checkpoint_dir: str) -> dict: ...
