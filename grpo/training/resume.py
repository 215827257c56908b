"""What a run saves beyond the engine's weights and optimizer (the step, the data sampler, the algorithm's state,
the reference it synced to), and how ``--resume`` brings it all back (docs/checkpoints.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from grpo.foundation.console import say
from grpo.foundation import dist, lora
from grpo.foundation.config import ConfigError
from grpo.training.checkpoint import (checkpoint_to_resume, export_model, load_checkpoint, prune_reference_folders,
                                      reference_folder, resume_mismatch, save_checkpoint, stored_folder)


def save(trainer: Any) -> Path:
    """A checkpoint of the trainer's run at its present step (``train.keep_checkpoints`` pruned)."""
    t = trainer
    state = {"step": t.step, "sampler": t.sampler.state_dict(), "algo": t.algo.state_dict(),
             "algo_options": t.algo.options_state_dict()}
    if t.stream is not None:  # streamed rollouts: the groups in flight, drawn again first at resume
        state["stream"] = t.stream.state_dict()
    if t.reference is not None and t.reference.folder:
        # relative to the run folder when inside it: a run folder moved (or copied) still resumes
        state["reference"] = {"folder": stored_folder(t.out, t.reference.folder), "version": t.reference.version}
    return save_checkpoint(t.engine, t.tokenizer, t.out, t.step, state, keep=t.cfg.train.keep_checkpoints)


def save_before_stopping(trainer: Any) -> None:
    """An outside service is gone for good: the steps done since the last checkpoint are kept (every rank calls
    this, together), so that ``--resume`` continues once the service is back."""
    if trainer.step > trainer._saved_step:
        path = trainer.save()
        if dist.is_main():
            say(f"saved the last finished step before stopping: {path} (continue with --resume once the service "
                f"is back)", err=True)


def finish(trainer: Any, last_saved: Optional[Path]) -> None:
    """The end of a run: a checkpoint of its last step (unless the loop just saved one), the final model exported
    (``train.export_final``), the metrics plot; their paths printed."""
    t = trainer
    if last_saved is None or not last_saved.name.endswith(f"-{t.step}"):
        last_saved = t.save()
        if dist.is_main() and t.reference is not None:
            prune_reference_folders(t.out, t.reference.folder)
    final = export_model(t.engine, t.tokenizer, t.out / "final") if t.cfg.train.export_final else None
    plot = t.logger.close()
    if dist.is_main():
        print(f"final checkpoint: {last_saved}", flush=True)
        if final is not None:
            print(f"final model (from_pretrained): {final}", flush=True)
        if plot:
            print(f"plot: {plot}", flush=True)


def resume(trainer: Any) -> None:
    """The trainer's run continued from the newest checkpoint in its output folder: weights, optimizer, step,
    sampler, the algorithm's state, the synced reference; the generation engine gets the restored weights."""
    t = trainer
    ckpt = checkpoint_to_resume(t.out)
    mismatch = resume_mismatch(t.model, ckpt)
    if mismatch:
        raise ConfigError(f"--resume from {ckpt}: the run is not set up as the checkpoint was ({mismatch}); "
                          f"resume with the checkpoint's settings, or start a new train.output_dir")
    state = load_checkpoint(t.engine, ckpt)
    t.step = int(state["step"])
    t.sampler.load_state_dict(state["sampler"])
    pending = (state.get("stream") or {}).get("pending", [])
    if pending and t.stream is None:
        raise ConfigError(f"--resume from {ckpt}: the run streamed its rollouts (rollout.max_staleness >= 1) and "
                          f"{len(pending)} of its groups were in flight; resume with rollout.max_staleness >= 1 so "
                          f"that they are drawn again (else their prompts would be skipped)")
    if t.stream is not None:
        t.stream.requeue([(t.dataset.ids[i], i) for i in pending])
    t.algo.load_state_dict(state.get("algo", {}))
    t.algo.load_options_state_dict(state.get("algo_options", {}))
    ref_state = state.get("reference") or {}
    if t.reference is not None and ref_state.get("folder"):  # it had been synced: bring it back
        folder = reference_folder(t.out, ref_state["folder"])
        t.reference.restore(folder, ref_state.get("version"))
        if t.reference.kind == "adapters-off":
            lora.set_base_name(t.model, folder)
    t.rollout.sync_weights()  # the engine generates with the restored weights
    if dist.is_main():
        print(f"resumed from {ckpt} at step {t.step}", flush=True)
