"""The reference server's HTTP path on loopback: round trip minus the server's own forward, per request.

    python scripts/benchmarks/bench_ref_http.py                        # 64 rows x (40 + 256) tokens, 20 requests
    python scripts/benchmarks/bench_ref_http.py --rows 64 --prompt 40 --completion 256 --requests 50 --model builtin:tiny-char

The sizes on the wire depend on rows x tokens only (int32 token ids up, float32 log-probs down), not on the
model: the built-in tiny model keeps the forward short, so what is measured is the path (client encode,
HTTP, the server's parse, queue hand-off, encode, client decode). Reports the median and p90 per request,
its parts (the server's parse and wait from the answer's header, the client's encode + decode, the rest), and
the client's encode and decode timed alone (medians of 10, in this process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo.foundation.logprobs import pack  # noqa: E402
from grpo.foundation.modeling import load_tokenizer  # noqa: E402
from grpo.foundation.tiny import BUILTIN_NAME  # noqa: E402
from grpo.reference.http import HTTPReference  # noqa: E402
from grpo.reference.launch import ServerProcess, free_port  # noqa: E402
from grpo.reference.wire import decode_response, encode_flat_response, encode_request  # noqa: E402
from grpo.training.configure import load_config  # noqa: E402


def random_packed(rows: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    comps = [torch.randint(4, vocab, (completion,), generator=g).tolist() for _ in range(rows)]
    return pack(prompts, comps, pad_id=0, width=completion)


def measure(url: str, model: str, rows: int, prompt: int, completion: int, requests: int) -> dict:
    """Per-request seconds (medians, p90) of the round trip, the server's forward, and the path between."""
    tokenizer = load_tokenizer(model)
    cfg = load_config(None, None, [f"ref.url={url}", f"train.micro_batch_size={rows}"])
    client = HTTPReference(cfg, tokenizer, None)
    packed = random_packed(rows, prompt, completion, len(tokenizer))
    trips, forwards, parts = [], [], {"parse": [], "wait": [], "codec": []}
    try:
        for i in range(requests + 2):  # two warm-up requests
            t0 = time.perf_counter()
            client.logprobs(packed, 1.0)
            trip = time.perf_counter() - t0
            m = client.pop_metrics()
            if i >= 2:
                trips.append(trip)
                forwards.append(m["ref/server_compute"])
                for k in parts:
                    parts[k].append(m[f"ref/{'client_' if k == 'codec' else 'server_'}{k}"])
        body = encode_request(packed, 1.0, False, 0, rows)
        answer = encode_flat_response(torch.zeros(int(packed.length.sum())), None, {"compute_ms": 0.0})
        t_enc, t_dec = [], []
        for _ in range(10):  # the client's encode and decode alone, in this process (medians)
            t0 = time.perf_counter()
            encode_request(packed, 1.0, False, 0, rows)
            t1 = time.perf_counter()
            decode_response(answer, packed.length, packed.width)
            t_enc.append(t1 - t0)
            t_dec.append(time.perf_counter() - t1)
    finally:
        client.close()
    paths = [t - f for t, f in zip(trips, forwards)]
    q = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]  # noqa: E731
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    rest = [p - sum(parts[k][i] for k in parts) for i, p in enumerate(paths)]
    return {"rows": rows, "prompt": prompt, "completion": completion, "requests": requests,
            "request_kib": len(body) / 1024, "answer_kib": len(answer) / 1024,
            "round_trip_ms": ms(trips), "server_forward_ms": ms(forwards),
            "http_path_ms": ms(paths), "http_path_p90_ms": 1000 * q(paths),
            # the path's parts, per request: the server reading and checking the body, its wait for the device
            # thread beyond the forward, the client's encode + decode, and the rest (sockets, HTTP, the answer's encode)
            "server_parse_ms": ms(parts["parse"]), "server_wait_ms": ms(parts["wait"]),
            "client_codec_ms": ms(parts["codec"]), "rest_ms": ms(rest),
            "client_encode_ms": ms(t_enc), "client_decode_ms": ms(t_dec)}


def run(model: str = BUILTIN_NAME, rows: int = 64, prompt: int = 40, completion: int = 256, requests: int = 20,
        extra_server_args: tuple[str, ...] = ()) -> dict:
    """Start a server on a free loopback port, measure, stop it."""
    with tempfile.TemporaryDirectory(prefix="bench_ref_http_") as tmp:
        server = ServerProcess(["--model", model, "--max-batch-tokens", str(rows * (prompt + completion)),
                                *extra_server_args], port=free_port(), log_path=Path(tmp) / "server.log")
        with server:
            return measure(server.url, model, rows, prompt, completion, requests)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=BUILTIN_NAME, help="what the server loads (an HF folder or builtin:tiny-char)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--requests", type=int, default=20)
    args = p.parse_args()
    r = run(args.model, args.rows, args.prompt, args.completion, args.requests)
    print(json.dumps(r))
    print(f"\n{args.rows} x ({args.prompt} + {args.completion}) tokens, {args.requests} requests: round trip "
          f"{r['round_trip_ms']:.1f} ms, server forward {r['server_forward_ms']:.1f} ms, HTTP path "
          f"{r['http_path_ms']:.2f} ms (p90 {r['http_path_p90_ms']:.2f} ms; server parse {r['server_parse_ms']:.2f}, "
          f"wait {r['server_wait_ms']:.2f}, client codec {r['client_codec_ms']:.2f}, rest {r['rest_ms']:.2f}); request {r['request_kib']:.0f} KiB, "
          f"answer {r['answer_kib']:.0f} KiB; client encode {r['client_encode_ms']:.2f} ms, decode "
          f"{r['client_decode_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
