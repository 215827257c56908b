"""Every registered algorithm trains the demo task for a few steps on 2 CPU ranks.

One deepspeed launch runs them all in turn (tests/algo_smoke_worker.py); this test is
parametrised over the registry and checks each algorithm's status and metrics.
"""

from __future__ import annotations

import json

import pytest

from algos import ALGORITHMS
from grpo.metrics import read_metrics
from tests.conftest import run_deepspeed

pytestmark = pytest.mark.slow
NAMES = sorted(ALGORITHMS)
SMALL = ["rollout.prompts_per_step=4", "rollout.num_generations=4", "train.micro_batch_size=6"]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("algos")
    run_deepspeed(["--algos", ",".join(NAMES), "--out", str(out), *SMALL], 2, "tests/algo_smoke_worker.py",
                  timeout=900)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_trains_on_two_ranks(smoke_runs, name):
    status = json.loads((smoke_runs / name / "status.json").read_text())
    assert status["ok"], status.get("traceback", status)
    rows = read_metrics(smoke_runs / name / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward/mean", "advantage/mean", "advantage/std", "advantage/zero_group_frac",
                "completion/length_mean", "completion/truncated_frac", "loss"):
        assert key in rows[-1], key
    assert (smoke_runs / name / "checkpoints" / "latest").exists()
