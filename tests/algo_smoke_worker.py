"""Run under a launcher (tests.conftest.run_deepspeed): train each named algorithm for a few steps in turn.

One launch serves every algorithm (starting the launcher costs more than the steps), and
each algorithm gets a fresh Trainer and engine. Rank 0 writes OUT/NAME/status.json with
"ok" or the error and the step the run started at, which the parametrised test reads. A plan entry may also name the run's
``algo`` (default: its key, so one algorithm can run twice under two keys), ``resume``
(``--resume`` from the run's output folder) and ``crash_of`` ({"run": an earlier run's output folder,
"step": N, "text_latest": bool}: the output folder starts as a copy of that run as if it had crashed
right after its step-N checkpoint, made by rank 0 before the run); its overrides come last and win
(output folder, checkpoints, plots).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def crash_after(full: Path, crashed: Path, step: int, text_latest: bool = False) -> Path:
    """A copy of the run in ``full`` as if it had crashed right after its step-``step`` checkpoint: the later step
    folders gone, ``latest`` naming step-``step`` (a symlink, or with ``text_latest`` the text file runs wrote
    before the symlink)."""
    from grpo.training.checkpoint import LATEST

    shutil.copytree(full, crashed, symlinks=True)
    for later in (crashed / "checkpoints").glob("step-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    (crashed / "checkpoints" / LATEST).unlink()
    if text_latest:
        (crashed / "checkpoints" / LATEST).write_text(f"step-{step}")
    else:
        (crashed / "checkpoints" / LATEST).symlink_to(f"step-{step}")
    return crashed


def run_plan(plan: dict, out_dir: Path, steps: int = 3) -> None:
    """Train each run of ``plan`` in turn (also called by tests/dist_grad_worker.py's launch)."""
    # imported here, not at the top: the trainer's imports (torch, transformers, DeepSpeed) cost seconds of CPU,
    # which a process importing this file for crash_after or run_plan's signature need not pay
    from grpo.foundation import dist
    from grpo.training.configure import load_config
    from grpo.training.trainer import Trainer

    root = Path(__file__).resolve().parent.parent
    for name, entry in plan.items():
        if isinstance(entry, dict):
            config, overrides = entry.get("config", "configs/demo.yaml"), entry["overrides"]
            algo, resume = entry.get("algo", name), bool(entry.get("resume", False))
        else:
            config, overrides, algo, resume = "configs/demo.yaml", entry, name, False
        out = out_dir / name
        status: dict = {"algo": name, "config": config}
        crash = entry.get("crash_of") if isinstance(entry, dict) else None
        if crash:  # the run's output folder (the last override names it), made before the run by rank 0
            if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise SystemExit(f"{name}: crash_of needs an earlier run in the plan (the ranks wait for the copy)")
            if dist.is_main():
                folder = Path(next(o for o in reversed(overrides) if o.startswith("train.output_dir=")).partition("=")[2])
                crash_after(Path(crash["run"]), folder, crash["step"], crash.get("text_latest", False))
            dist.barrier()
        try:
            cfg = load_config(root / config, algo=algo, overrides=[
                f"train.max_steps={steps}", f"train.output_dir={out}", "train.save_every=0",
                "logging.progress_bar=false", "logging.plot=false", *overrides,
            ])
            trainer = Trainer(cfg, resume=resume)
            status["start_step"] = trainer.step  # where --resume picked the run up (0: a new run)
            trainer.train()
            status["ok"] = True
        except Exception as e:  # recorded for the test to report; the next algorithm still runs
            status.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        if dist.is_main():
            out.mkdir(parents=True, exist_ok=True)
            (out / "status.json").write_text(json.dumps(status))
        dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True, help="JSON file: {algorithm name: [key=value overrides]} (on "
                   "configs/demo.yaml), or {algorithm name: {\"config\": YAML file, \"overrides\": [...]}}")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    run_plan(json.loads(Path(args.plan).read_text()), Path(args.out), args.steps)


if __name__ == "__main__":
    main()
