"""scripts/benchmarks/bench.py --profile (issue 41, item 2): one more step after the measured ones, its rest (everything
after generation) under torch.profiler, summarised in the JSON and the Markdown, the measured steps left as they are
(TRL's side is profiled the same way, from its ``_generate`` to the end of its step; TRL is not in the test
environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.patience import LAUNCH_S

ROOT = Path(__file__).resolve().parent.parent


def test_the_rest_of_the_last_step_is_profiled(tmp_path):
    from grpo.foundation.tiny import write_tiny

    model = write_tiny(tmp_path / "m")
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "bench.py"), "--model", str(model),
                           "--device", "cpu", "--algo", "grpo", "--prompts", "2", "--group", "2", "--max-new", "4",
                           "--micro-batch", "2", "--steps", "1", "--warmup", "1", "--threads", "1", "--profile",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "bench-grpo-fp32.json").read_text())
    ours = report["results"]["ours"]
    prof = ours["profile"]
    assert len(ours["steps"]) == 2  # the warm-up and the measured step: the profiled one is not among them
    assert prof["wall_ms"] > 0 and prof["kernels"] > 0 and prof["sync_ops"] >= 0  # (on CPU, kernels are CPU ops)
    assert prof["top"] and prof["host_top"] and all(t["calls"] > 0 for t in prof["top"])
    names = {t["name"] for t in prof["top"]} | {t["name"] for t in prof["host_top"]}
    assert any("mm" in n for n in names)  # the log-prob and training passes' matrix products are in it
    assert "under torch.profiler" in (out / "bench-grpo-fp32.md").read_text()
