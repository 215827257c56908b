"""Reference sync: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, whatever the reference's kind (``ref.sync_every``,
ProRL's resets through ``StepContext.reset_reference``).

The new reference's weights are written to OUT/reference/step-N (an HF folder: what a resumed run reloads, and
what a reference server loads). In-process copy: mixed in place. Server: rank 0 mixes the server's present
weights (the folder of the last sync, or the initial model) with the policy's and the server reloads the folder
(alpha = 1: the policy's export). LoRA's adapters-off reference: the mix is merged into the policy's base and the
adapter keeps the rest, so the policy itself does not change (grpo.foundation.lora.sync_base).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpo.foundation import dist, lora
from grpo.foundation.config import Config
from grpo.foundation.modeling import load_model
from grpo.training import deepspeed_engine as ds
from grpo.training.checkpoint import export_model, write_weights


def sync_reference(ref: Any, alpha: float, out: Path, step: int, cfg: Config, engine: Any, tokenizer: Any,
                   rollout: Any) -> tuple[str, int]:
    """The reference ``ref`` (a grpo.reference.handle handle) moved toward the policy of ``engine`` (collective);
    returns (the folder holding it, the reference's new version)."""
    # absolute: a reference server resolves the folder on its side, not in this run's working directory
    folder = str((out / "reference" / f"step-{step}").resolve())
    model = engine.module
    if ref is None:
        raise RuntimeError("sync_reference: this run has no reference (beta = 0)")
    if ref.kind == "adapters-off":
        if cfg.teacher.adapter:  # the teacher is this base plus its own adapter: moving the base moves the teacher
            raise RuntimeError(f"a reference sync with LoRA merges the policy into its base, and teacher.adapter="
                               f"{cfg.teacher.adapter!r} shares that base: the teacher would change. Name the "
                               f"reference apart (ref.model or ref.url) or the teacher apart (teacher.model)")
        lora.sync_base(model, alpha)  # the same arithmetic on every rank
        if dist.is_main():
            write_weights(model, lora.base_state_dict(model), tokenizer, folder)
        dist.barrier()
        lora.set_base_name(model, folder)  # adapters saved from now on name their new base
        rollout.sync_weights()  # the merged policy is the same up to rounding: the engine gets it exactly
        return folder, ref.synced(folder)
    if alpha == 1.0 and (ref.remote or ref.partitioned or ds.partitions_weights(engine)):
        export_model(engine, tokenizer, folder)
        whole = None if ref.remote or ref.partitioned else whole_policy(cfg, engine, tokenizer, folder)
        return folder, ref.load_policy(folder, whole)
    need = dist.is_main() or not ref.remote or ds.partitions_weights(engine)  # (ZeRO-3: collective)
    policy = whole_policy(cfg, engine, tokenizer, folder) if need else None

    def current() -> dict[str, torch.Tensor]:
        """A server's present weights (rank 0): the folder of the last sync, else the model it started with."""
        source = ref.folder or cfg.ref.model or cfg.model.name_or_path
        return load_model(cfg.model, source, apply_freeze=False).state_dict()

    version = ref.mix(policy, alpha, folder, lambda state, where: write_weights(model, state, tokenizer, where),
                      current)
    return folder, version


def whole_policy(cfg: Config, engine: Any, tokenizer: Any, folder: str) -> dict[str, torch.Tensor]:
    """The policy's weights under transformers' names (LoRA: merged), whole. Under ZeRO-3 they are exported to
    ``folder`` first (collective) and read back."""
    if ds.partitions_weights(engine):
        export_model(engine, tokenizer, folder)
        return load_model(cfg.model, folder, apply_freeze=False).state_dict()
    model = engine.module
    return lora.merged_state_dict(model) if lora.has_lora(model) else model.state_dict()
