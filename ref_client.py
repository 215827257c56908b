"""Serve a frozen reference model over HTTP for the trainer (``ref.url``); docs/reference-server.md.

    CUDA_VISIBLE_DEVICES=7 python ref_client.py                                  # the trainer's default model
    deepspeed train.py --algo grpo ref.url=http://127.0.0.1:59875                # ... and a run that uses it (beta 0.04)
    CUDA_VISIBLE_DEVICES=7 python ref_client.py --config configs/grpo.yaml      # the config's ref.model
    python ref_client.py --model path/or/hub-name --port 59875 --dtype bf16     # or without a config
    GRPO_REF_TOKEN=secret python ref_client.py --config c.yaml --host 0.0.0.0   # other machines: token required
    python ref_client.py --config c.yaml --reward-model path/to/rm              # a reward model beside it
    python ref_client.py --config c.yaml --teacher-model path/to/teacher        # a distillation teacher beside it

Host, port and limits come from the config's ``ref`` section (flags and key=value overrides
beat it; without --config, the trainer's defaults: the same model on 127.0.0.1:59875); the model
is ``ref.model``, else ``model.name_or_path``. Stop it with Ctrl-C or SIGTERM: requests in flight
finish first.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config whose reference model to serve (see configs/; default: the "
                                    "trainer's defaults, as for `train.py` without --config)")
    p.add_argument("--model", help="model folder, hub name or builtin:tiny-char (beats the config's)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="weights dtype (default: the config's model.dtype)")
    p.add_argument("--host", help="bind address (default 127.0.0.1; any other needs a token)")
    p.add_argument("--port", type=int, help="port (default 59875; 0 = any free port, printed at start)")
    p.add_argument("--token", help="bearer token clients must send (better: the GRPO_REF_TOKEN environment variable)")
    p.add_argument("--max-batch-tokens", type=int, help="padded tokens per forward pass")
    p.add_argument("--max-queue", type=int, help="queued requests before answering 503")
    p.add_argument("--max-request-mb", type=float, help="largest request body in MiB (413 beyond)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (only for models you trust)")
    p.add_argument("--reward-model", help="also serve this sequence classifier as a reward model (POST /v1/reward; "
                                          "the trainer's rewards: [{model: ..., where: server}]; docs/rewards.md)")
    p.add_argument("--teacher-model", help="also serve this model as on-policy distillation's teacher (the same "
                                           "tokenizer; the trainer's teacher.url names this server: docs/distillation.md)")
    p.add_argument("--reward-label", help="the reward model's label to read (default: its only logit)")
    p.add_argument("--reward-batch-tokens", type=int, help="padded tokens per reward forward pass (default: "
                                                           "ref.max_batch_tokens)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. ref.max_queue=16")
    return p.parse_args(argv)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """Numeric and choice flags as config overrides, so they pass the same validation as the YAML."""
    pairs = [("model.dtype", args.dtype), ("ref.port", args.port), ("ref.max_batch_tokens", args.max_batch_tokens),
             ("ref.max_queue", args.max_queue), ("ref.max_request_mb", args.max_request_mb)]
    out = [f"{k}={v}" for k, v in pairs if v is not None]
    if args.trust_remote_code:
        out.append("model.trust_remote_code=true")
    return out


def check_device(device: str) -> None:
    """--device names a torch device this machine has: a ConfigError saying which ones, not torch's traceback."""
    import torch

    from grpo.foundation.config import ConfigError

    try:
        d = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a torch device: give cpu, cuda or cuda:N") from None
    if d.type != "cuda":
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not n:
        raise ConfigError(f"--device {device!r}: this torch sees no CUDA GPU (torch {torch.__version__}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); give --device cpu")
    if d.index is not None and d.index >= n:
        raise ConfigError(f"--device {device!r}: {n} GPU(s) visible (cuda:0 to cuda:{n - 1}, after "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from grpo.foundation.config import ConfigError
    from grpo.training.configure import load_config

    try:
        cfg = load_config(args.config, None, [*args.overrides, *flag_overrides(args)])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for name in ("model", "host", "token"):  # free-form strings: set as given, not parsed as YAML
        if getattr(args, name) is not None:
            setattr(cfg.ref, name, getattr(args, name))
    import torch

    from grpo.reference.server.app import serve

    from grpo.foundation.modeling import check_model_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    reward = None
    try:
        check_device(device)
        check_model_path("ref.model" if cfg.ref.model else "model.name_or_path",
                         cfg.ref.model or cfg.model.name_or_path)
        if args.reward_batch_tokens is not None and args.reward_batch_tokens <= 0:
            raise ConfigError(f"--reward-batch-tokens {args.reward_batch_tokens} is invalid: it must be > 0 (padded "
                              f"tokens per reward forward pass; left out, ref.max_batch_tokens)")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.reward_model:
        from grpo.scoring.models import RewardModel  # composed here, handed down to the server's worker

        reward = {"model": args.reward_model, "label": args.reward_label, "batch_tokens": args.reward_batch_tokens,
                  "dtype": cfg.model.dtype if args.dtype else None, "load": RewardModel}
    try:
        return serve(cfg, device, reward=reward, teacher=args.teacher_model)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port is taken
        print(f"error: cannot serve on {cfg.ref.host}:{cfg.ref.port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
