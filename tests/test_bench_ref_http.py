"""scripts/benchmarks/bench_ref_http.py: a real server on loopback, the HTTP path measured per request."""

from __future__ import annotations

from tests.script_support import load_script


def test_http_path_is_round_trip_minus_the_servers_forward():
    r = load_script("benchmarks/bench_ref_http").run(rows=4, prompt=3, completion=5, requests=3)
    assert r["round_trip_ms"] > r["server_forward_ms"] > 0
    assert 0 < r["http_path_ms"] < r["round_trip_ms"] and r["http_path_p90_ms"] >= r["http_path_ms"]
    assert r["request_kib"] > 0 and r["answer_kib"] >= 4 * 5 * 4 / 1024  # 4 rows x 5 float32 log-probs
