"""The reference computed in this process: a frozen copy of the reference model (InProcessReference), or with
LoRA the policy itself with its adapters off (AdapterDisabledReference); and with LoRA a teacher that is the
policy's base with another adapter (AdapterTeacher). All implement grpo.reference.protocol.Reference; the HTTP
server's client is in http.py.
"""

from __future__ import annotations

import gc
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from grpo.foundation.config import Config
from grpo.foundation.logprobs import Packed, Scores, check_head
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

    def __init__(self, cfg: Config, device: torch.device, load: Optional[Loader] = None, synced: bool = False,
                 source: Optional[str] = None):
        """``source``: the model to load (default: ``ref.model``, else the policy's start; the teacher's:
        ``teacher.model``)."""
        self.cfg, self.synced = cfg, synced
        self.load = load or (lambda source: load_whole(cfg, source, device))
        self.source = source or cfg.ref.model or cfg.model.name_or_path
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

        return in_eval(self.cfg, self.model, adapters_disabled(self.model), packed, temperature, top_k)

    def reload(self, checkpoint_dir: str) -> dict:
        from grpo.foundation.lora import load_base
        from grpo.foundation.modeling import load_model

        load_base(self.model, load_model(self.cfg.model, checkpoint_dir, apply_freeze=False).state_dict())
        self.version += 1
        self.source = checkpoint_dir
        return self.info()


TEACHER_ADAPTER = "teacher"  # the name of teacher.adapter beside the policy's own adapter


class AdapterTeacher(_LocalReference):
    """On-policy distillation's teacher with LoRA (``teacher.adapter``): the policy's frozen base with another adapter,
    loaded beside the policy's own in the same model (grpo.foundation.lora.add_adapter: no second copy of the base).
    Its log-probs run in eval mode with that adapter active; then the policy's adapter is active again, every
    ``requires_grad`` as it was, and the model's mode restored."""

    kind = "adapter"

    def __init__(self, cfg: Config, model: torch.nn.Module):
        from grpo.foundation.lora import add_adapter

        self.cfg, self.model, self.version = cfg, model, 0
        self.source = str(cfg.teacher.adapter)
        add_adapter(model, cfg.teacher.adapter, TEACHER_ADAPTER)

    def scores(self, packed: Packed, temperature: float, top_k: int = 0) -> Scores:
        from grpo.foundation.lora import adapter_active

        return in_eval(self.cfg, self.model, adapter_active(self.model, TEACHER_ADAPTER), packed, temperature, top_k)

    def reload(self, checkpoint_dir: str) -> dict:
        raise RuntimeError("a teacher adapter (teacher.adapter) is fixed for the run: it is not reloaded")


def in_eval(cfg: Config, model: torch.nn.Module, context, packed: Packed, temperature: float, top_k: int) -> Scores:
    """``model``'s scores of ``packed`` in eval mode within ``context`` (its adapters switched), the mode restored."""
    was_training = model.training
    model.eval()
    try:
        with context:
            return sliced_scores(model, packed, temperature, cfg.train.logprob_chunk_size,
                                 max_rows=cfg.train.micro_batch_size, top_k=top_k)
    finally:
        model.train(was_training)


def load_whole(cfg: Config, source: str, device: torch.device) -> torch.nn.Module:
    """The reference model, whole, frozen, on ``device``."""
    from grpo.foundation.modeling import load_model

    model = load_model(cfg.model, source).to(device).eval()
    model.requires_grad_(False)
    check_head(model)  # a teacher may be of another family than the policy
    return model
