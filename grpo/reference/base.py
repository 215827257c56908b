"""Reference log-probs: a frozen in-process copy, or (LoRA) the policy with its adapters off, here; the
HTTP server's client is in http.py.

All implement :class:`Reference`; grpo/reference/handle.py wraps either for the trainer and the
algorithms. ``submit`` starts the work and returns a future whose ``result()`` gives [rows, width]
log-probs, so a remote request can run while the trainer scores rewards and computes old log-probs.
"""

from __future__ import annotations

import gc
from concurrent.futures import Future
from typing import Callable, Optional, Protocol

import torch

from grpo.foundation import dist
from grpo.foundation.config import Config
from grpo.foundation.logprobs import Packed, completion_logprobs


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
def sliced_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    temperature: float,
    chunk_size: int,
    max_rows: Optional[int] = None,
    max_tokens: Optional[int] = None,
    with_entropy: bool = False,
    synced: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[rows, width] float32 CPU log-probs (and entropy) of ``packed``, one forward pass per row slice.

    The in-process reference and the reference server both call this, so the same rows in the
    same slices give bit-identical results whichever side computes them. ``synced`` (a model
    partitioned under ZeRO-3, whose weights are gathered inside every forward): every rank runs
    as many forward passes as the busiest one, each the same sequence of module calls.
    """
    lps, ents = [], []
    slices = row_slices(packed.input_ids.shape[0], packed.input_ids.shape[1], max_rows, max_tokens)
    if synced:
        extra = int(dist.all_reduce_max(torch.tensor([float(len(slices))], dtype=torch.float64))[0]) - len(slices)
        idle = Packed(torch.zeros((1, 2), dtype=torch.long), torch.ones((1, 2), dtype=torch.long),
                      torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1)
        for _ in range(extra):  # a rank with fewer rows joins the others' weight gathers
            completion_logprobs(model, idle, temperature, chunk_size, share_prefix=False)
    for sl in slices:
        part = Packed(packed.input_ids[sl], packed.attention_mask[sl], packed.start[sl], packed.length[sl], packed.width)
        lp, ent = completion_logprobs(model, part, temperature, chunk_size, with_entropy, share_prefix=not synced)
        lps.append(lp.float())  # on the device: one copy to the host at the end, not one wait per slice
        if ent is not None:
            ents.append(ent.float())
    return torch.cat(lps).cpu(), (torch.cat(ents).cpu() if with_entropy else None)


class Reference(Protocol):
    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]": ...
    def info(self) -> dict: ...
    def reload(self, checkpoint_dir: str) -> dict: ...


class _LocalReference:
    """What the references computed in this process share: an answer that is ready when submitted."""

    source: str
    version: int

    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        raise NotImplementedError

    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        fut: Future = Future()
        fut.set_result(self.logprobs(packed, temperature))
        return fut

    def info(self) -> dict:
        return {"model": self.source, "version": self.version}


Loader = Callable[[str], torch.nn.Module]  # an HF folder or name -> the frozen reference model


class InProcessReference(_LocalReference):
    """A frozen copy of the reference model on this rank's device.

    ``load`` builds it (default: whole, on ``device``); under ZeRO-3 the trainer passes one that builds
    it partitioned over the ranks like the policy, and ``synced`` makes its forwards collective."""

    def __init__(self, cfg: Config, device: torch.device, load: Optional[Loader] = None, synced: bool = False):
        self.cfg, self.synced = cfg, synced
        self.load = load or (lambda source: load_whole(cfg, source, device))
        self.source = cfg.ref.model or cfg.model.name_or_path
        self.model = self.load(self.source)
        self.version = 0

    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        return sliced_logprobs(self.model, packed, temperature, self.cfg.train.logprob_chunk_size,
                               max_rows=self.cfg.train.micro_batch_size, synced=self.synced)[0]

    def reload(self, checkpoint_dir: str) -> dict:
        self.model = None  # the old copy goes before the new one comes
        gc.collect()  # (a partitioned copy and its engine refer to each other)
        self.model = self.load(checkpoint_dir)
        self.version += 1
        self.source = checkpoint_dir
        return self.info()


class AdapterDisabledReference(_LocalReference):
    """The reference for free with LoRA: the policy itself with its adapters switched off, i.e. its frozen base.

    ``model`` is the trainer's model (the DeepSpeed engine's module): nothing is copied or loaded. Its
    log-probs run in eval mode under ``adapters_disabled`` and the model's mode is restored afterwards.
    ``reload(folder)`` puts base weights from an HF folder back into the policy's frozen base (a resumed
    run whose reference had been synced): the policy, base + adapter, moves with it.
    """

    def __init__(self, cfg: Config, model: torch.nn.Module):
        self.cfg = cfg
        self.model = model
        self.version = 0
        self.source = cfg.model.name_or_path

    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        from grpo.foundation.lora import adapters_disabled

        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                return sliced_logprobs(self.model, packed, temperature, self.cfg.train.logprob_chunk_size,
                                       max_rows=self.cfg.train.micro_batch_size)[0]
        finally:
            self.model.train(was_training)

    def reload(self, checkpoint_dir: str) -> dict:
        from grpo.foundation.lora import load_base
        from grpo.foundation.modeling import load_model

        load_base(self.model, load_model(self.cfg.model, checkpoint_dir, apply_freeze=False).state_dict())
        self.version += 1
        self.source = checkpoint_dir
        return self.info()


def load_whole(cfg: Config, source: str, device: torch.device) -> torch.nn.Module:
    """The reference model, whole, frozen, on ``device``."""
    from grpo.foundation.modeling import load_model

    model = load_model(cfg.model, source).to(device).eval()
    model.requires_grad_(False)
    return model
