"""The reference computed in this process: a frozen copy of the reference model (InProcessReference), or with
LoRA the policy itself with its adapters off (AdapterDisabledReference). Both implement
grpo.reference.protocol.Reference; the HTTP server's client is in http.py.
"""

from __future__ import annotations

import gc
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from grpo.foundation.config import Config
from grpo.foundation.logprobs import Packed, Scores
from grpo.reference.protocol import sliced_scores


def _ready(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class _LocalReference:
    """What the references computed in this process share: an answer that is ready when submitted."""

    source: str
    version: int

    def scores(self, packed: Packed, temperature: float, top_k: int = 0) -> Scores:
        raise NotImplementedError

    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        return self.scores(packed, temperature).logprobs

    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        return _ready(self.logprobs(packed, temperature))

    def submit_topk(self, packed: Packed, temperature: float, top_k: int) -> "Future[Scores]":
        return _ready(self.scores(packed, temperature, top_k))

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

    def scores(self, packed: Packed, temperature: float, top_k: int = 0) -> Scores:
        return sliced_scores(self.model, packed, temperature, self.cfg.train.logprob_chunk_size,
                             max_rows=self.cfg.train.micro_batch_size, synced=self.synced, top_k=top_k)

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

    def scores(self, packed: Packed, temperature: float, top_k: int = 0) -> Scores:
        from grpo.foundation.lora import adapters_disabled

        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                return sliced_scores(self.model, packed, temperature, self.cfg.train.logprob_chunk_size,
                                     max_rows=self.cfg.train.micro_batch_size, top_k=top_k)
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
