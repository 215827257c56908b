"""Reference log-probs through the server (ref_client.py, loopback HTTP) against in-process.

    python scripts/benchmarks/bench_ref.py                    # both batches, 3 timed runs each
    python scripts/benchmarks/bench_ref.py --only smollm2 --repeats 5

Two batches: the demo's (tiny model, one rank's 256 rows of 3 prompt + 3 completion
tokens) and a SmolLM2-135M-sized one (16 rows x (100 prompt + 128 completion) tokens). The
SmolLM2 model is models/smollm2-135m-instruct/ when present, else a randomly initialised
LlamaForCausalLM of SmolLM2-135M's shape with a synthetic 49152-token tokenizer (the output
says which). Both sides run the same function on the same rows with the same number of CPU
threads (OMP/MKL_NUM_THREADS); the order alternates so machine load hits both alike. Medians.

    in-process   the forward pass in this process (what ref.url unset does)
    server       the client's round trip: encode, HTTP, queue, forward, encode, decode
    overhead     server - in-process;  HTTP path = server - the server's own forward time
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch (after one warm-up)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads on each side")
    p.add_argument("--only", choices=["demo", "smollm2"], help="run one batch only")
    return p.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    # Set before torch starts: this process and the server get the same OpenMP/MKL environment.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

from grpo.foundation.config import ModelConfig  # noqa: E402
from grpo.training.configure import load_config  # noqa: E402
from grpo.foundation.logprobs import Packed, pack  # noqa: E402
from grpo.foundation.modeling import load_model, load_tokenizer  # noqa: E402
from grpo.reference.http import HTTPReference  # noqa: E402
from grpo.reference.launch import ServerProcess, free_port  # noqa: E402
from grpo.reference.protocol import sliced_logprobs  # noqa: E402
from grpo.foundation.tiny import BUILTIN_NAME  # noqa: E402

SMOLLM_DIR = ROOT / "models" / "smollm2-135m-instruct"
SMOLLM_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5)


def random_smollm2(folder: Path, shape: dict = SMOLLM_SHAPE, device: str = "cpu", dtype=None,
                   classifier: bool = False) -> Path:
    """A random-init LlamaForCausalLM of ``shape`` (SmolLM2-135M's by default), built on ``device`` in ``dtype``,
    and a word-level tokenizer of its vocabulary ("t4" ... as words). ``classifier``: a
    LlamaForSequenceClassification with one logit instead (a reward model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    with torch.device(device):  # a GPU initialises a 1.7B model in seconds, a CPU in minutes
        conf = LlamaConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, **({"num_labels": 1} if classifier else {}))
        model = (LlamaForSequenceClassification if classifier else LlamaForCausalLM)(conf)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def batch(rows: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int, seed: int = 0) -> Packed:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(*prompt))] for _ in range(rows)]
    comps = [[rng.randrange(4, vocab) for _ in range(rng.randint(*completion))] for _ in range(rows)]
    return pack(prompts, comps, pad_id=0, width=completion[1])


def bench(name: str, model_path: str, packed: Packed, rows_per_pass: int, repeats: int, threads: int, log_dir: Path) -> dict:
    """Median seconds: in-process forward, server round trip, server-side forward."""
    torch.set_num_threads(threads)
    model = load_model(ModelConfig(), model_path).eval()
    model.requires_grad_(False)  # as the in-process reference and the server hold it
    tokenizer = load_tokenizer(model_path)
    server = ServerProcess(["--model", model_path, "--max-batch-tokens", str(packed.input_ids.numel())], port=free_port(),
                           log_path=log_dir / f"server-{name}.log")  # inherits OMP/MKL_NUM_THREADS
    with server:
        cfg = load_config(None, None, [f"ref.url={server.url}", f"train.micro_batch_size={rows_per_pass}"])
        client = HTTPReference(cfg, tokenizer, model.config.vocab_size)
        local, remote, remote_fwd = [], [], []
        runs = {"local": lambda: sliced_logprobs(model, packed, 1.0, 1024, max_rows=rows_per_pass)[0],
                "remote": lambda: client.logprobs(packed, 1.0)[0]}
        for i in range(repeats + 1):  # the first round warms both up and is not counted
            out, secs = {}, {}
            for key in (["local", "remote"] if i % 2 == 0 else ["remote", "local"]):  # alternate the order
                t0 = time.perf_counter()
                out[key] = runs[key]()
                secs[key] = time.perf_counter() - t0
            m = client.pop_metrics()
            if not torch.equal(out["remote"], out["local"]):
                diff = (out["remote"] - out["local"]).abs().max()
                raise SystemExit(f"{name}: the server's log-probs differ from in-process by {diff:.3g}")
            if i:
                local.append(secs["local"])
                remote.append(secs["remote"])
                remote_fwd.append(m["ref/server_compute"])
        sent, received = m["ref/bytes_sent"], m["ref/bytes_received"]
        client.close()
    return {"local": statistics.median(local), "remote": statistics.median(remote),
            "remote_fwd": statistics.median(remote_fwd), "sent": sent, "received": received}


def main(args: argparse.Namespace) -> int:

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_ref_") as tmp:
        tmp_dir = Path(tmp)
        if args.only in (None, "demo"):
            packed = batch(256, (3, 3), (1, 3), vocab=93)
            results.append(("demo: tiny-char, 256 x (3 + 3) tokens",
                            bench("demo", BUILTIN_NAME, packed, 256, args.repeats, args.threads, tmp_dir)))
        if args.only in (None, "smollm2"):
            if SMOLLM_DIR.is_dir():
                path, label = str(SMOLLM_DIR), "SmolLM2-135M-Instruct"
            else:
                print(f"{SMOLLM_DIR} does not exist: using a randomly initialised LlamaForCausalLM of SmolLM2-135M's "
                      f"shape (hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152, tied "
                      f"embeddings) with a synthetic 49152-token tokenizer", flush=True)
                path, label = str(random_smollm2(tmp_dir / "smollm2-shape")), "SmolLM2-135M shape, random init"
            packed = batch(16, (100, 100), (128, 128), vocab=SMOLLM_SHAPE["vocab_size"])
            results.append((f"{label}, 16 x (100 + 128) tokens",
                            bench("smollm2", path, packed, 16, args.repeats, args.threads, tmp_dir)))

    print(f"\nfloat32, CPU, {args.threads} thread(s) per side, median of {args.repeats} runs; "
          f"server answers checked bit-identical to in-process\n")
    print("| batch | in-process | server (round trip) | server forward | overhead vs in-process | HTTP path (round trip - server forward) | sent / received |")
    print("|---|---|---|---|---|---|---|")
    for label, r in results:
        over, path = r["remote"] - r["local"], r["remote"] - r["remote_fwd"]
        print(f"| {label} | {1000 * r['local']:.1f} ms | {1000 * r['remote']:.1f} ms | {1000 * r['remote_fwd']:.1f} ms | "
              f"{1000 * over:+.1f} ms ({100 * over / r['local']:+.1f}%) | {1000 * path:.1f} ms ({100 * path / r['remote_fwd']:.1f}%) | "
              f"{r['sent'] / 1024:.1f} / {r['received'] / 1024:.1f} KiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
