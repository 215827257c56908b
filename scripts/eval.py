"""Evaluate a model on a config's held-out problems: accuracy, format rate, mean completion length.

    python scripts/eval.py --model PATH --config configs/X.yaml [--split eval|train] [--limit N] [--k 1]
                           [--out FILE.jsonl] [key=value ...]

PATH is anything ``model.name_or_path`` takes: an HF folder (the original model, or a
checkpoint the trainer saved, e.g. runs/X/checkpoints/step-N, or runs/X/checkpoints/latest,
runs/X/checkpoints or runs/X for the run's newest), a hub name, or
builtin:tiny-char; or a LoRA adapter folder (a LoRA run's checkpoint, or what
``PeftModel.save_pretrained`` wrote): its base (``base_model_name_or_path``) with the adapter merged. Greedy decoding; with --k > 1 also k samples per problem at
``eval.temperature`` (mean@k, pass@k). Writes one JSONL record per problem (default:
runs/eval/<model>-<split>.jsonl) and prints the summary (also as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def default_out(model: str, split: str) -> Path:
    p = Path(model)
    name = "-".join(p.parts[-3:]) if p.exists() else model.replace(":", "-").replace("/", "-")
    return ROOT / "runs" / "eval" / f"{name.replace('/', '-')}-{split}.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF folder, checkpoint folder (or a run's checkpoints/latest, checkpoints/ or output folder: "
                        "its newest), LoRA adapter folder, hub name or builtin:tiny-char")
    p.add_argument("--config", required=True, help="YAML whose data / eval / rewards sections define the task")
    p.add_argument("--split", default="eval", help="'eval' (alias 'test': the held-out data) or 'train'")
    p.add_argument("--limit", type=int, default=None, help="first N problems (default: eval.limit)")
    p.add_argument("--k", type=int, default=None, help="samples per problem for mean@k / pass@k (default: eval.k)")
    p.add_argument("--out", type=Path, default=None, help="per-problem JSONL (default: runs/eval/<model>-<split>.jsonl)")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. eval.batch_size=16")
    args = p.parse_args(argv)

    from grpo.foundation.config import ConfigError
    from grpo.foundation.config_rules import custom_chat_template
    from grpo.training.configure import load_config

    overrides = [f"model.name_or_path={args.model}", *args.overrides]
    if args.limit is not None:
        overrides.append(f"eval.limit={args.limit}")
    if args.k is not None:
        overrides.append(f"eval.k={args.k}")
    split = "eval" if args.split == "test" else args.split
    try:
        cfg = load_config(args.config, None, overrides)
        import torch

        from grpo.foundation.modeling import eos_token_ids, load_model, load_tokenizer
        from grpo.rollout.service import RolloutService
        from grpo.training.evaluation import Evaluator, eval_source, write_records

        tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
        if (template := custom_chat_template(cfg.data)) is not None:  # the template the run was trained with
            tokenizer.chat_template = template
        model = load_model(cfg.model).eval()
        rollout = RolloutService.build(cfg, model, tokenizer, eos_token_ids(model, tokenizer))
        evaluator = Evaluator(cfg, rollout, eval_source(cfg, split))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    torch.manual_seed(cfg.train.seed)
    result = evaluator.run()
    evaluator.close()
    m = result.metrics

    # a run's checkpoint given as checkpoints/latest: named after the step folder it resolved to
    out = write_records(result.records, args.out or default_out(cfg.model.name_or_path, split))
    fmt = f"{m['eval/format_rate']:.3f}" if "eval/format_rate" in m else "n/a (no eval.format reward)"
    print(f"model: {args.model}   split: {split}   problems: {int(m['eval/num_problems'])}"
          f"   (dropped as too long: {int(m['eval/dropped_prompts'])})")
    print(f"accuracy (greedy): {m['eval/accuracy']:.3f}")
    print(f"format rate: {fmt}")
    print(f"mean completion length: {m['eval/length_mean']:.1f} tokens (truncated: {m['eval/truncated_frac']:.3f})")
    k = cfg.eval.k
    if k > 1:
        print(f"mean@{k}: {m[f'eval/mean@{k}']:.3f}   pass@{k}: {m[f'eval/pass@{k}']:.3f}")
    failed = {key: v for key, v in m.items() if key.endswith(("/errors", "/timeouts")) and v}
    if failed:
        print(f"reward failures (scored 0): {failed}")
    print(f"per-problem results: {out}   ({time.time() - t0:.0f} s)")
    if args.json:
        print(json.dumps({"model": args.model, "split": split, **m}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
