"""Train a policy with an algorithm of the GRPO family on a DeepSpeed engine.

    deepspeed train.py --algo grpo --config configs/demo.yaml [key=value ...] [--resume]
    python train.py --list-algos
    python train.py --algo dapo --config configs/demo.yaml --print-config

With the reference model on a GPU of its own (docs/reference-server.md): the server serves the model of the
config it is given (none: the trainer's defaults) on ref.port, and the run points ref.url at it:

    CUDA_VISIBLE_DEVICES=7 python ref_client.py
    deepspeed train.py --algo grpo ref.url=http://127.0.0.1:59875
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file (see configs/)")
    p.add_argument("--algo", help="algorithm name (see --list-algos); beats the YAML's algo.name")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.output_dir")
    p.add_argument("--list-algos", action="store_true", help="print the algorithm registry and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-5")
    # flags may sit between the key=value overrides (`train.lr=1e-5 --print-config algo.beta=0`)
    return p.parse_intermixed_args(argv)


def list_algos() -> str:
    import dataclasses

    from grpo.foundation.config import AlgoConfig
    from grpo.foundation.plugins import ALGORITHMS

    def defaults(cls) -> dict:
        fields = [*dataclasses.fields(AlgoConfig), *dataclasses.fields(cls.Options)]
        return {**{f.name: f.default for f in fields if f.default is not dataclasses.MISSING}, **cls.defaults}

    lines = []
    for name, cls in ALGORITHMS.items():
        values = defaults(cls)
        knobs = ", ".join(f"{k}={values[k]!r}" if isinstance(values.get(k), str) else f"{k}={values.get(k)}"
                          for k in cls.knobs)
        lines.append(f"{name:<12} {cls.paper}  [{cls.tag}]\n{'':<12} {cls.summary}\n{'':<12} knobs: {knobs}")
    return "\n".join(lines)


DEMO = Path(__file__).resolve().parent / "configs" / "demo.yaml"
OWN_TASK = ("model", "data", "rewards", "env")  # sections whose keys say the run is not the built-in task


def config_path(args: argparse.Namespace) -> str | None:
    """The YAML the run starts from: ``--config``; without it, when no override names a model, data, rewards or an
    environment, the demo task (configs/demo.yaml: the built-in tiny model learns to copy two digits, visibly within
    a minute on a CPU, where the bare defaults' 256-token completions at lr 1e-5 learn nothing to see)."""
    if args.config is not None or not DEMO.is_file():
        return args.config
    if any(o.split("=", 1)[0].split(".", 1)[0] in OWN_TASK for o in args.overrides):
        return None
    return str(DEMO)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_algos:
        print(list_algos())
        return 0
    from grpo.foundation.config import ConfigError
    from grpo.foundation.config_assembly import to_dict
    from grpo.foundation.loader import dump_yaml
    from grpo.training.configure import check_run, load_config, probe_services, run_warnings

    try:  # one validation, before any model loads, for --print-config and the run alike
        path = config_path(args)
        cfg = load_config(path, args.algo, args.overrides)
        parts = check_run(cfg, resume=args.resume)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        for warning in run_warnings(cfg, parts):
            print(f"config warning: {warning}", file=sys.stderr)
    from grpo.reference.protocol import ReferenceServerError

    try:  # a reference server nobody runs: seconds, not a minute of retries after loading (--print-config too)
        probe_services(cfg, parts)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ReferenceServerError as e:
        print(f"reference error: {e}", file=sys.stderr)
        return 1
    if args.print_config:
        print(dump_yaml(to_dict(cfg)), end="")
        return 0
    from grpo.foundation import dist
    from grpo.training.health import Interrupted, TrainingStopped
    from grpo.foundation.plugins import RewardServiceError
    from grpo.training.trainer import Trainer

    if args.config is None and path is not None and dist.is_main():
        print(f"no --config: the demo task ({os.path.relpath(path)}: a tiny model learns to copy two digits); give "
              f"--config for your own", flush=True)
    finished = False
    try:
        trainer = Trainer(cfg, resume=args.resume, parts=parts)  # composed once, by check_run
        trainer.train()
        finished = True
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ReferenceServerError as e:  # the reference server is gone: the message says how to restart it
        print(f"reference error: {e}", file=sys.stderr)
        return 1
    except RewardServiceError as e:  # a reward model server or endpoint is gone: the message names it
        print(f"reward error: {e}", file=sys.stderr)
        return 1
    except TrainingStopped as e:  # the watchdogs: non-finite steps, or a reward failing on most rows, in a row
        print(f"training stopped: {e}", file=sys.stderr)
        return 3
    except Interrupted as e:  # Ctrl-C: the step in progress finished and was saved
        if dist.is_main():
            print(f"interrupted after step {e.step}, saved in {e.checkpoint}; continue with the same command and "
                  f"--resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
        if dist.is_main():
            print(f"interrupted: the step in progress was not saved; --resume continues from the newest checkpoint "
                  f"in {cfg.train.output_dir}/checkpoints", file=sys.stderr)
        return 130
    finally:
        # Every exit path tears the process group down while the interpreter is whole (left to interpreter
        # exit, ZeRO-3's communication threads sometimes aborted it). Only a finished run waits for the
        # other ranks: after an error they may never arrive.
        dist.shutdown(wait=finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
