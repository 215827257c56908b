"""Merge a LoRA adapter into its base and write a plain HF model folder.

    python scripts/merge_lora.py ADAPTER_DIR OUT_DIR [--base PATH] [--dtype fp32|bf16|fp16]

ADAPTER_DIR is a folder in PEFT's format (adapter_config.json + adapter_model.safetensors): a LoRA
run's checkpoint (runs/X/checkpoints/step-N) or anything ``PeftModel.save_pretrained`` wrote. The
base is the one the adapter names (``base_model_name_or_path``: the run's model.name_or_path, or the
reference folder its base was synced to) unless --base is given; builtin:tiny-char works too.
PEFT's ``merge_and_unload`` folds W + (alpha / r) B A into each adapted layer; OUT_DIR then loads
with ``AutoModelForCausalLM.from_pretrained`` (and scripts/eval.py --model OUT_DIR). The tokenizer is
the adapter folder's when it has one, else the base's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def merge(adapter_dir: str | Path, out_dir: str | Path, base: str | None = None, dtype: str = "fp32") -> Path:
    from peft import PeftModel

    from grpo.foundation.config import ConfigError, ModelConfig
    from grpo.foundation.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base_name, mark_untied_if_needed
    from grpo.foundation.modeling import load_model, load_tokenizer

    adapter_dir, out = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{adapter_dir} holds no {ADAPTER_CONFIG}: give a LoRA run's checkpoint folder "
                          "(runs/X/checkpoints/step-N) or a folder PeftModel.save_pretrained wrote")
    try:
        json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{adapter_dir / ADAPTER_CONFIG} is not valid JSON ({e}): the adapter folder is corrupt; "
                          "use another checkpoint") from e
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        pickled = [f for f in ("adapter_model.bin", "adapter_model.pt") if (adapter_dir / f).is_file()]
        raise ConfigError(f"{adapter_dir} holds no {ADAPTER_WEIGHTS}" + (
            f"; its {pickled[0]} is a pickle, which could run code when loaded: refusing it (convert it to "
            f"safetensors where you trust it)" if pickled else ": the adapter's weights are missing"))
    named = adapter_base_name(adapter_dir)
    base = base or named
    model = load_model(ModelConfig(name_or_path=base, dtype=dtype))
    _check_base(adapter_dir, named, base, model)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    mark_untied_if_needed(merged)  # a trained output head (modules_to_save) is not the embeddings any more
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    has_tokenizer = any((adapter_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    load_tokenizer(str(adapter_dir) if has_tokenizer else base).save_pretrained(str(out))
    return out


SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "vocab_size")


def _check_base(adapter_dir: Path, named: str, base: str, model) -> None:
    """--base must be the model the adapter was trained on: the same shape as the base the adapter names (when
    that one can be read here), and a vocabulary the adapter folder's tokenizer fits. ConfigError otherwise:
    another model of the same shapes merged silently, and its tokenizer was written beside another vocabulary."""
    from transformers import AutoConfig

    from grpo.foundation.config import ConfigError
    from grpo.foundation.modeling import load_tokenizer

    have = model.config.get_text_config()
    if base != named and Path(named).is_dir():
        want = AutoConfig.from_pretrained(named).get_text_config()
        diff = [f"{k}: {getattr(want, k, None)} vs {getattr(have, k, None)}" for k in SHAPE_KEYS
                if getattr(want, k, None) != getattr(have, k, None)]
        if diff:
            raise ConfigError(f"--base {base} is not the model this adapter was trained on ({named}): "
                              f"{'; '.join(diff)}")
    if any((adapter_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        n = len(load_tokenizer(str(adapter_dir)))
        if n > have.vocab_size:
            raise ConfigError(f"the adapter folder's tokenizer has {n} tokens and --base {base} a vocabulary of "
                              f"{have.vocab_size}: they are not the same model; give the base it was trained on")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter_dir", help="folder with adapter_config.json + adapter_model.safetensors")
    p.add_argument("out_dir", help="where the merged HF model is written")
    p.add_argument("--base", default=None, help="base model (default: the adapter's base_model_name_or_path)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="dtype of the merged weights")
    args = p.parse_args(argv)
    from grpo.foundation.config import ConfigError

    try:
        out = merge(args.adapter_dir, args.out_dir, args.base, args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged model: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
