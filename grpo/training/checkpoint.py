"""Atomic checkpoints: HF model + tokenizer, DeepSpeed engine state, and trainer state.

Layout: ``OUT/checkpoints/step-N/`` holds an HF folder (config, safetensors, tokenizer) so
it loads with ``from_pretrained``; ``ds/`` holds optimizer + scheduler; ``trainer/`` holds
each rank's RNG, data position and algorithm state. With LoRA the folder holds the adapter in
PEFT's format instead of the whole model (``adapter_config.json``, ``adapter_model.safetensors``:
``PeftModel.from_pretrained(base, folder)`` loads it; ``scripts/merge_lora.py`` merges it), and
``ds/`` only the adapter's weights (the frozen base is not copied into every checkpoint). Everything
is written to a temporary folder first, fsynced (files and folders) and renamed; ``latest`` (a relative
symlink to the step folder, so ``OUT/checkpoints/latest`` loads like the folder itself; runs written before
it was a symlink hold a text file naming the folder, still read) is replaced atomically last (a new
symlink renamed over it), so a crash mid-save never leaves a half checkpoint as the latest. Saving a
step whose folder exists (a finished run resumed, which saves its last step again) renames the old
folder aside to ``.old-step-N`` instead of deleting it first; until the new one is in place
``latest_checkpoint`` falls back to that copy, so ``latest`` always resolves.

The trainer state is loaded with ``torch.load(weights_only=True)``: tensors and plain data
only (RNG states are stored as such), so a checkpoint someone else made cannot run code here.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from grpo.foundation import dist
from grpo.foundation.console import no_save_bars
from grpo.foundation.config import ConfigError
from grpo.foundation.lora import has_lora, merged_state_dict, same_base, save_adapter, state_dict_for_save
from grpo.foundation.modeling import ASIDE, LATEST, latest_in


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest complete step folder of the run in ``output_dir`` (what ``--resume`` continues), or None."""
    return latest_in(checkpoints_dir(output_dir))


def checkpoint_to_resume(output_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from; ConfigError when the run in ``output_dir`` has none."""
    ckpt = latest_checkpoint(output_dir)
    if ckpt is None:
        raise ConfigError(f"--resume: no checkpoint in {checkpoints_dir(output_dir)}; start without --resume, or set "
                          f"train.output_dir to the run to continue")
    return ckpt


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under ``folder`` to disk (a rename is only as durable as what it names)."""
    for dirpath, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _link_atomic(path: Path, target: str) -> None:
    """Point the symlink ``path`` at ``target`` (relative to its folder): a new link renamed over the old one
    (a symlink or the older text file), so ``path`` always names one folder or the other."""
    tmp = path.with_name(f".{path.name}.tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    if path.is_dir() and not path.is_symlink():  # a copied run's link became a folder: kept aside, not lost
        os.replace(path, path.with_name(f"{ASIDE}{path.name}-copy"))
    os.symlink(target, tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``; an existing ``final`` is renamed aside first, not deleted,
    so a crash between the two renames leaves a complete copy that ``latest_checkpoint`` finds."""
    aside = final.with_name(ASIDE + final.name)
    if final.exists():
        if aside.exists():  # left by an earlier crash; ``final`` is complete, so nothing resolves to it
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain data (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    s = state["numpy"]
    if isinstance(s, dict):
        s = (s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
    np.random.set_state(s)  # else: a tuple holding an ndarray, as written before the tensor form
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
    # with LoRA the engine state keeps only what trains (the adapter), not the frozen base
    engine.save_checkpoint(str(tmp), tag="ds", **({"exclude_frozen_parameters": True} if lora else {}))
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
        _fsync_tree(tmp)
        _swap_in(tmp, final)
        _link_atomic(root / LATEST, final.name)
        for stale in root.glob(ASIDE + "step-*"):  # ``latest`` names a folder in place: no longer needed
            shutil.rmtree(stale, ignore_errors=True)
        if keep > 0:
            _prune(root, final, keep)
    dist.barrier()
    return final


def stored_folder(output_dir: str | Path, folder: str) -> str:
    """``folder`` as a checkpoint records it: relative to the run folder when inside it (a moved run resumes)."""
    run, f = Path(output_dir).resolve(), Path(folder).resolve()
    return str(f.relative_to(run)) if f == run or run in f.parents else str(f)


def reference_folder(output_dir: str | Path, recorded: str) -> str:
    """The absolute folder of a checkpoint's recorded reference: a relative one is in this run's folder; an
    absolute one (checkpoints written before paths were relative) that no longer exists but whose
    ``reference/step-N`` is in this run's folder (the run was moved) is that one."""
    run = Path(output_dir).resolve()
    path = Path(recorded)
    if not path.is_absolute():
        return str(run / path)
    if not path.exists() and path.parent.name == "reference" and (run / "reference" / path.name).is_dir():
        return str(run / "reference" / path.name)
    return str(path)


def prune_reference_folders(output_dir: str | Path, current: Optional[str]) -> list[Path]:
    """Delete the OUT/reference/step-* folders (written by ref.sync_every) that neither the reference in use
    (``current``) nor any checkpoint names (its trainer state's reference folder, which --resume reloads);
    returns them. Each sync wrote a whole model folder and none was ever deleted (a 7B run syncing every 50
    of 5000 steps: about 1.5 TB). A checkpoint whose state cannot be read keeps every folder. Rank 0 only."""
    folders = [p for p in (Path(output_dir) / "reference").glob("step-*") if p.is_dir()]
    if not folders:
        return []
    named = {Path(current).resolve()} if current else set()
    for ckpt in checkpoints_dir(output_dir).glob("step-*"):
        state = ckpt / "trainer" / "rank0.pt"
        if not state.is_file():
            continue
        try:
            folder = (load_trainer_state(state).get("reference") or {}).get("folder")
        except Exception:  # noqa: BLE001 - unsure what it needs: delete nothing
            return []
        if folder:
            named.add(Path(reference_folder(output_dir, folder)).resolve())
    removed = [p for p in folders if p.resolve() not in named]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def _prune(root: Path, latest: Path, keep: int) -> None:
    """Keep ``latest`` and the newest ``keep - 1`` other step folders; delete the rest. ``latest`` is never
    deleted, even when older-numbered than the others (a run restarted without --resume in the same folder)."""
    others = sorted((int(p.name.split("-")[1]), p) for p in root.glob("step-*")
                    if p.is_dir() and p.name != latest.name and p.name.split("-")[1].isdigit())
    for _, p in others[:max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(p, ignore_errors=True)


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


# an image-text-to-text checkpoint's processor files: what its processor (and vLLM, which builds it even for text)
# reads beside the weights and the tokenizer
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def write_weights(model, state_dict: dict, tokenizer, folder: str | Path) -> None:
    """An HF folder (``from_pretrained`` loads it) with ``model``'s config and these weights (transformers'
    names, e.g. a mixed reference's); an image-text-to-text model's processor files come along from the local
    folder it was loaded from (the trainer reads text through the tokenizer alone). Call it on one rank."""
    with no_save_bars():  # transformers draws a "Writing model shards" bar per save
        model.save_pretrained(str(folder), state_dict=state_dict_for_save(model, state_dict), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    loaded_from = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    source = Path(loaded_from)
    if loaded_from and source.is_dir() and source.resolve() != Path(folder).resolve():
        for name in PROCESSOR_FILES:
            if (source / name).is_file() and not (Path(folder) / name).exists():
                shutil.copy2(source / name, Path(folder) / name)


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


SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")


def resume_mismatch(model, path: Path) -> Optional[str]:
    """What differs between the checkpoint at ``path`` and the run's model (None: nothing that matters). With
    LoRA: the rank, alpha, adapted and saved modules and the base (another alpha rescaled the trained update,
    other target modules dropped the trained adapters and put their Adam moments on new ones); without: the
    architecture's shape. Both values are named."""
    import json

    adapter = path / "adapter_config.json"
    if has_lora(model) != adapter.is_file():
        return (f"the checkpoint {'holds a LoRA adapter' if adapter.is_file() else 'is a full fine-tune'} and "
                f"this run {'uses model.lora' if has_lora(model) else 'has no model.lora'}")
    diffs = []
    if adapter.is_file():
        saved = json.loads(adapter.read_text())
        now = model.peft_config["default"]
        pairs = {"r": (saved.get("r"), now.r), "alpha": (saved.get("lora_alpha"), now.lora_alpha),
                 "target_modules": (sorted(saved.get("target_modules") or []), sorted(now.target_modules or [])),
                 "modules_to_save": (sorted(saved.get("modules_to_save") or []), sorted(now.modules_to_save or []))}
        base = str(saved.get("base_model_name_or_path") or "")
        if base and not same_base(base, str(now.base_model_name_or_path)):  # (a synced base passes)
            pairs["model.name_or_path (the adapter's base)"] = (base, now.base_model_name_or_path)
        diffs = [f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in pairs.items() if a != b]
    elif (path / "config.json").is_file():
        saved = json.loads((path / "config.json").read_text())
        text = saved.get("text_config") or saved
        now = model.config.get_text_config()
        diffs = [f"{k}: {text.get(k)!r} in the checkpoint, {getattr(now, k, None)!r} now" for k in SHAPE_KEYS
                 if k in text and text.get(k) != getattr(now, k, None)]
    return "; ".join(diffs) or None


def _deepspeed_safe_globals() -> list:
    """The plain data classes DeepSpeed writes into its checkpoint files (found by loading ZeRO 0-3, LoRA and
    full checkpoints with weights_only=True): allowed to be rebuilt from their fields, nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path: str, map_location=None) -> Any:
    """torch.load of a DeepSpeed checkpoint file that never unpickles code: DeepSpeed's own checkpoint engine
    loads with weights_only=False, so a crafted ds/*.pt (a shared or downloaded run folder) ran code on
    --resume. RuntimeError naming the file when it holds anything but tensors and plain data."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals() + _deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise RuntimeError(
            f"{path} holds objects other than tensors and plain data, which could run code when loaded; refusing "
            f"to load it. Resume only from checkpoints this trainer wrote. ({_unpickler_reason(e)})"
        ) from e


def load_checkpoint(engine, path: Path) -> dict:
    """Restore engine (weights, optimizer, scheduler) and return this rank's trainer state. Every file is read
    without unpickling code: DeepSpeed's through :func:`weights_only_load`, ours with weights_only=True."""
    # with LoRA the engine state holds only the trainable weights (the adapter): the base is the model loaded
    strict = {"load_module_strict": False} if has_lora(engine.module) else {}
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is not None:  # its load is torch.load(weights_only=False)
        checkpoint_engine.load = weights_only_load
    load_path, _ = engine.load_checkpoint(str(path), tag="ds", **strict)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state in {path / 'ds'}")
    f = path / "trainer" / f"rank{dist.rank()}.pt"
    if not f.is_file():
        raise RuntimeError(
            f"{f} is missing: the checkpoint was written with a different number of ranks; "
            f"resume with the same world size"
        )
    state = load_trainer_state(f)
    set_rng_state(state.pop("rng"))
    return state


def _numpy_array_globals() -> list:
    """What unpickling an ndarray needs: trainer states written before RNG states were tensors hold one."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_trainer_state(f: Path) -> dict:
    """One rank's trainer state: tensors and plain data only, never code from the file."""
    return weights_only_load(str(f))


def _unpickler_reason(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else type(e).__name__)
    return reason[:300]
