"""scripts/benchmarks/http_servers.py: the reference server's HTTP layer passes every probe the comparison with
waitress and cheroot runs (docs/reference-server.md, "The HTTP layer"); the libraries are not installed here."""

from __future__ import annotations

import pytest

from tests.script_support import load_script

pytestmark = pytest.mark.slow


def test_our_http_layer_passes_every_probe():
    results = load_script("benchmarks/http_servers").run("ours", 3)
    assert set(results) == {"keep_alive", "trickled", "starved", "stalled", "over_limit", "client_left", "cost",
                            "drain"}
    failed = {probe: text for probe, (ok, text) in results.items() if not ok}
    assert not failed, failed
    assert "408" in results["stalled"][1] and "4194304 of 4194304 bytes" in results["drain"][1], results
