"""The reference as the trainer and the algorithms see it, whatever kind it is.

    logprobs / submit(packed, temperature)   reference log-probs (a future: a server works meanwhile)
    submit_topk(packed, temperature, k)      the same, and the k most likely next tokens at each position
    kind                                     "in-process" (a frozen copy), "adapters-off" (LoRA: the policy
                                             with its adapters off, no copy), "server", or "adapter" (a LoRA
                                             teacher: the policy's base with another adapter)
    version, folder                          bumped by every reload or sync; the HF folder the weights came
                                             from (None: the initial model)
    weights_hash()                           a server's hash of its weights (checked on --resume)
    reload(folder)                           load weights from an HF folder (collective: every rank calls it)
    mix(policy, alpha, folder, write)        pi_ref <- alpha pi_theta + (1 - alpha) pi_ref, written to folder
    load_policy(folder, weights)             pi_ref <- pi_theta (the folder holds the policy's export)
    restore(folder, version)                 a resumed run's reference: the folder it had, at its version

An in-process reference reloads on every rank; a reference server is told once, by rank 0, and
the answer is shared. The adapters-off kind is synced by the trainer itself (it merges into the
policy's base, grpo.foundation.lora.sync_base) and told with ``synced``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional

import torch

from grpo.foundation import dist
from grpo.foundation.config import MAX_TOP_K, Config
from grpo.foundation.logprobs import Packed, Scores
from grpo.reference.protocol import Reference
from grpo.reference.in_process import AdapterDisabledReference, InProcessReference, Loader

StateDict = dict[str, torch.Tensor]


class ReferenceHandle:
    def __init__(self, impl: Reference):
        self.impl = impl
        self.kind = getattr(impl, "kind", None) or ("adapters-off" if isinstance(impl, AdapterDisabledReference)
                                                    else "in-process" if isinstance(impl, InProcessReference)
                                                    else "server")
        self.remote = self.kind == "server"
        # an in-process copy partitioned over the ranks (ZeRO-3): no rank holds its whole state dict, so it is
        # synced like a server's (rank 0 writes the new weights, every rank loads them partitioned)
        self.partitioned = self.kind == "in-process" and impl.synced
        self._version: Optional[int] = None if self.remote else impl.version
        self.folder: Optional[str] = None  # where the current weights came from (None: the initial model)

    # ----------------------------------------------------------------- log-probs
    def submit(self, packed: Packed, temperature: float) -> "Future[torch.Tensor]":
        return self.impl.submit(packed, temperature)

    def logprobs(self, packed: Packed, temperature: float) -> torch.Tensor:
        return self.submit(packed, temperature).result()

    def submit_topk(self, packed: Packed, temperature: float, top_k: int) -> "Future[Scores]":
        """Log-probs and the ``top_k`` (<= MAX_TOP_K) most likely next tokens at each completion position."""
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={top_k}: a reference sends between 1 and {MAX_TOP_K} tokens per position")
        return self.impl.submit_topk(packed, temperature, top_k)

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
        self.folder = str(folder)
        return self.version

    def load_policy(self, folder: str, weights: Optional[StateDict] = None) -> int:
        """pi_ref <- pi_theta, where ``folder`` holds the policy's export. An in-process reference copies
        ``weights`` (the whole policy's state dict, transformers' names) directly when given; otherwise it
        loads the folder. Collective; returns the new version."""
        if self.remote or self.partitioned or weights is None:
            return self.reload(folder)
        return self.mix(weights, 1.0, folder)

    def mix(self, policy: Optional[StateDict], alpha: float, folder: str,
            write: Optional[Callable[[StateDict, str], None]] = None,
            current: Optional[Callable[[], StateDict]] = None) -> int:
        """pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref (grpo.foundation.lora.mix_, per weight).

        ``policy``: the whole policy's weights (transformers' names) on every rank, or only on rank 0 for a
        server. In-process: the copy is mixed in place on every rank, then rank 0 writes it to ``folder``
        with ``write(state_dict, folder)`` (when given). Server, and an in-process copy partitioned under
        ZeRO-3: rank 0 mixes ``current()`` (the present weights, loaded from where they came from) with the
        policy, writes the result to ``folder`` and the reference reloads it. Collective; returns the new
        version.
        """
        from grpo.foundation.weights import mix_state_

        if self.kind == "adapters-off":
            raise RuntimeError("the adapters-off reference is synced in the policy's base (lora.sync_base), "
                               "then told with synced()")
        if self.remote or self.partitioned:
            if dist.is_main():
                ref = current()
                mix_state_(ref, policy, alpha)
                write(ref, folder)
            dist.barrier()
            return self.reload(folder)
        ref = self.impl
        own = ref.model.state_dict()
        mix_state_(own, policy, alpha)
        if write is not None:
            if dist.is_main():
                write(own, folder)
            dist.barrier()
        return self.synced(folder)

    def synced(self, folder: str) -> int:
        """The in-process weights were changed in place (a sync) and saved to ``folder``: a new version."""
        ref = self.impl
        ref.version += 1
        ref.source = str(folder)
        self._version, self.folder = ref.version, str(folder)
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


def adapters_off_reference(cfg: Config) -> bool:
    """With LoRA and neither ``ref.url`` nor ``ref.model``, the reference is the policy with its adapters off."""
    return cfg.model.lora is not None and not cfg.ref.url and not cfg.ref.model


def make_reference(cfg: Config, needed: bool, device: torch.device, tokenizer=None,
                   vocab_size: Optional[int] = None, policy: Optional[torch.nn.Module] = None,
                   load: Optional[Loader] = None, synced: bool = False) -> Optional[ReferenceHandle]:
    """None when the algorithm does not use a reference (beta = 0): nothing is loaded or queried.

    ``tokenizer`` and ``vocab_size`` are the policy's: a reference server must match both. ``policy`` is
    the trainer's model: with LoRA (``adapters_off_reference``) it is the reference, adapters off.
    ``load`` and ``synced``: how an in-process copy is built (partitioned under ZeRO-3) and whether its
    forwards are collective.
    """
    if not needed:
        return None
    if cfg.ref.url:
        from grpo.reference.http import HTTPReference  # the server's client (ref_client.py serves it)

        return ReferenceHandle(HTTPReference(cfg, tokenizer, vocab_size))
    if adapters_off_reference(cfg):
        if policy is None:
            raise ValueError("make_reference: with model.lora the reference is the policy; pass it as policy=")
        return ReferenceHandle(AdapterDisabledReference(cfg, policy))
    return ReferenceHandle(InProcessReference(cfg, device, load, synced))
