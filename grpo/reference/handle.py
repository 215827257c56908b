"""The reference as the trainer and the algorithms see it, whatever kind it is.

    logprobs / submit(packed, temperature)   reference log-probs (a future: a server works meanwhile)
    version                                  bumped by every reload or reset
    weights_hash()                           a server's hash of its weights (checked on --resume)
    reload(folder)                           load weights from an HF folder (collective: every rank calls it)
    load_policy(folder, model)               pi_ref <- pi_theta (the folder holds the policy's export)
    restore(folder, version)                 a resumed run's reference: the folder it had, at its version

An in-process reference reloads on every rank; a reference server is told once, by rank 0, and
the answer is shared. Nobody outside this file branches on the kind.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

import torch

from grpo.foundation import dist
from grpo.foundation.config import Config
from grpo.foundation.logprobs import Packed
from grpo.reference.base import InProcessReference, Reference


class ReferenceHandle:
    def __init__(self, impl: Reference):
        self.impl = impl
        self.remote = not isinstance(impl, InProcessReference)
        self._version: Optional[int] = None if self.remote else impl.version

    # ----------------------------------------------------------------- log-probs
    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        return self.impl.submit(packed, temperature)

    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        return self.submit(packed, temperature).result()

    # ----------------------------------------------------------------- weights
    @property
    def version(self) -> int:
        """The reference's weight version (0: the initial model); the same on every rank (collective on
        its first use with a server)."""
        if self._version is None:
            info = self.impl.info() if dist.is_main() else None
            self._version = int(dist.broadcast_object(info).get("version", 0))
        return self._version

    def weights_hash(self) -> Optional[str]:
        """A server's hash of the weights it serves (None in-process: the copy is the one this run loaded
        or reset). Collective."""
        if not self.remote:
            return None
        info = self.impl.info() if dist.is_main() else None
        return dist.broadcast_object(info).get("weights_hash")

    @property
    def source(self) -> str:
        return str(getattr(self.impl, "source", "") or self.impl.info().get("model", ""))

    def reload(self, folder: str) -> int:
        """Load the reference from an HF folder; returns the new version. Collective."""
        if self.remote:  # one (admin) reload call, from rank 0
            info = self.impl.reload(folder) if dist.is_main() else None
            info = dist.broadcast_object(info)
        else:
            info = self.impl.reload(folder)
        if isinstance(info, dict) and "version" in info:
            self._version = int(info["version"])
        return self.version

    def load_policy(self, folder: str, model: Optional[torch.nn.Module] = None) -> int:
        """pi_ref <- pi_theta, where ``folder`` holds the policy's export. An in-process reference copies
        ``model``'s weights directly when given (the whole, unpartitioned policy); otherwise it loads the
        folder. Collective; returns the new version."""
        if self.remote or model is None:
            return self.reload(folder)
        ref = self.impl
        ref.model.load_state_dict(model.state_dict())
        ref.version += 1
        ref.source = str(folder)
        self._version = ref.version
        return self._version

    def restore(self, folder: str, version: Optional[int]) -> int:
        """A resumed run's reference: load ``folder``; an in-process one also takes back its ``version``
        (a server's version is its own). Collective."""
        self.reload(folder)
        if not self.remote and version is not None:
            self.impl.version = self._version = int(version)
        return self.version

    # ----------------------------------------------------------------- run
    def info(self) -> dict:
        return self.impl.info()

    def pop_metrics(self) -> dict[str, float]:
        pop = getattr(self.impl, "pop_metrics", None)
        return pop() if pop is not None else {}

    def close(self) -> None:
        close = getattr(self.impl, "close", None)
        if close is not None:
            close()


def make_reference(cfg: Config, needed: bool, device: torch.device, tokenizer=None,
                   vocab_size: Optional[int] = None) -> Optional[ReferenceHandle]:
    """None when the algorithm does not use a reference (beta = 0): nothing is loaded or queried.

    ``tokenizer`` and ``vocab_size`` are the policy's: a reference server must match both.
    """
    if not needed:
        return None
    if cfg.ref.url:
        from grpo.reference.http import HTTPReference  # the server's client (ref_client.py serves it)

        return ReferenceHandle(HTTPReference(cfg, tokenizer, vocab_size))
    return ReferenceHandle(InProcessReference(cfg, device))
