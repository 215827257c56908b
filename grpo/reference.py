"""Reference log-probs: a frozen in-process copy, or (ref.url set) the HTTP reference server.

Both implement :class:`Reference`. ``submit`` starts the work and returns a handle whose
``result()`` gives [rows, width] log-probs, so a remote request can run while the trainer
scores rewards and computes old log-probs.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional, Protocol

import torch

from grpo.config import Config
from grpo.logprobs import Packed, completion_logprobs


class Reference(Protocol):
    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]": ...
    def info(self) -> dict: ...
    def reload(self, checkpoint_dir: str) -> dict: ...


class InProcessReference:
    """A frozen copy of the reference model on this rank's device."""

    def __init__(self, cfg: Config, device: torch.device):
        from grpo.modeling import load_model

        self.cfg = cfg
        self.model = load_model(cfg.model, cfg.ref.model or cfg.model.name_or_path).to(device).eval()
        self.model.requires_grad_(False)
        self.version = 0
        self.source = cfg.ref.model or cfg.model.name_or_path

    @torch.no_grad()
    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        chunk = self.cfg.train.logprob_chunk_size
        rows = packed.input_ids.shape[0]
        mbs = self.cfg.train.micro_batch_size
        outs = []
        for s in range(0, rows, mbs):
            sl = slice(s, s + mbs)
            part = Packed(packed.input_ids[sl], packed.attention_mask[sl], packed.start[sl], packed.length[sl], packed.width)
            outs.append(completion_logprobs(self.model, part, temperature, chunk)[0].float().cpu())
        return torch.cat(outs)

    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        fut: Future = Future()
        fut.set_result(self.logprobs(packed, temperature))
        return fut

    def info(self) -> dict:
        return {"model": self.source, "version": self.version}

    def reload(self, checkpoint_dir: str) -> dict:
        from grpo.modeling import load_model

        device = next(self.model.parameters()).device
        self.model = load_model(self.cfg.model, checkpoint_dir).to(device).eval()
        self.model.requires_grad_(False)
        self.version += 1
        self.source = checkpoint_dir
        return self.info()


def make_reference(cfg: Config, needed: bool, device: torch.device, tokenizer=None) -> Optional[Reference]:
    """None when the algorithm does not use a reference (beta = 0): nothing is loaded or queried."""
    if not needed:
        return None
    if cfg.ref.url:
        from grpo.ref_http import HTTPReference  # the server's client (ref_client.py serves it)

        return HTTPReference(cfg, tokenizer)
    return InProcessReference(cfg, device)
