"""Atomic checkpoints: HF model + tokenizer, DeepSpeed engine state, and trainer state.

Layout: ``OUT/checkpoints/step-N/`` holds an HF folder (config, safetensors, tokenizer) so
it loads with ``from_pretrained``; ``ds/`` holds optimizer + scheduler; ``trainer/`` holds
each rank's RNG, data position and algorithm state. With LoRA the folder holds the adapter in
PEFT's format instead of the whole model (``adapter_config.json``, ``adapter_model.safetensors``:
``PeftModel.from_pretrained(base, folder)`` loads it; ``scripts/merge_lora.py`` merges it), and
``ds/`` only the adapter's weights (the frozen base is not copied into every checkpoint). Everything is written to a temporary
folder first and renamed; ``latest`` is replaced atomically last, so a crash mid-save
never leaves a half checkpoint as the latest.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from grpo.foundation import dist
from grpo.foundation.lora import has_lora, merged_state_dict, save_adapter, state_dict_for_save

LATEST = "latest"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    root = checkpoints_dir(output_dir)
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if path.is_dir() else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(engine, tokenizer, output_dir: str | Path, step: int, trainer_state: dict, keep: int = 0) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if dist.is_main():
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    lora = has_lora(engine.module)
    engine.save_checkpoint(str(tmp), tag="ds", exclude_frozen_parameters=lora)
    if lora:
        if dist.is_main():
            save_adapter(engine.module, tmp)
            tokenizer.save_pretrained(str(tmp))
    else:
        _write_hf(engine, tokenizer, tmp)
    (tmp / "trainer").mkdir(exist_ok=True)
    torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer" / f"rank{dist.rank()}.pt")
    dist.barrier()
    if dist.is_main():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, final.name)
        if keep > 0:
            steps = sorted((int(p.name.split("-")[1]), p) for p in root.glob("step-*") if p.is_dir())
            for _, p in steps[:-keep]:
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def _write_hf(engine, tokenizer, folder: Path) -> None:
    """HF weights + tokenizer, consolidated on rank 0 (ZeRO-3 gathers the partitions). Collective.
    With LoRA: the adapted policy's weights, merged (base + scale * B A)."""
    if engine.zero_optimization_partition_weights():
        state_dict = engine._zero3_consolidated_16bit_state_dict()
    elif has_lora(engine.module):
        state_dict = merged_state_dict(engine.module) if dist.is_main() else None
    else:
        state_dict = engine.module.state_dict() if dist.is_main() else None
    if dist.is_main():
        write_weights(engine.module, state_dict, tokenizer, folder)


def write_weights(model, state_dict: dict, tokenizer, folder: str | Path) -> None:
    """An HF folder (``from_pretrained`` loads it) with ``model``'s config and these weights (transformers'
    names, e.g. a mixed reference's). Call it on one rank."""
    model.save_pretrained(str(folder), state_dict=state_dict_for_save(model, state_dict), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))


def export_model(engine, tokenizer, folder: str | Path) -> Path:
    """Collective: write the policy as an HF folder (``from_pretrained`` loads it), atomically."""
    final = Path(folder)
    tmp = final.with_name(f".tmp-{final.name}")
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _write_hf(engine, tokenizer, tmp)
    dist.barrier()
    if dist.is_main():
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load_checkpoint(engine, path: Path) -> dict:
    """Restore engine (weights, optimizer, scheduler) and return this rank's trainer state."""
    # with LoRA the engine state holds only the trainable weights (the adapter): the base is the model loaded
    load_path, _ = engine.load_checkpoint(str(path), tag="ds", load_module_strict=not has_lora(engine.module))
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state in {path / 'ds'}")
    f = path / "trainer" / f"rank{dist.rank()}.pt"
    if not f.is_file():
        raise RuntimeError(
            f"{f} is missing: the checkpoint was written with a different number of ranks; "
            f"resume with the same world size"
        )
    state = torch.load(f, weights_only=False)
    set_rng_state(state.pop("rng"))
    return state
