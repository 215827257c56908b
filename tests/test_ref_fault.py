"""The reference server dies during training (`python train.py`, one process, tiny model).

Restarted within ref.retry_window: training completes and metrics.jsonl has every step once.
Not restarted: the trainer stops with the clear error and the last checkpoint loads.
The two tests share one server: the first kills and restarts it, the second kills it for good.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.training.checkpoint import latest_checkpoint
from grpo.training.metrics import read_metrics
from grpo.reference.launch import ROOT, ServerProcess, free_port
from tests.conftest import LAUNCHER_VARS
from tests.patience import LAUNCH_S, SERVER_S, STEP_S

pytestmark = pytest.mark.slow

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the trainer and the server share this machine's cores


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("ref_fault") / "server.log"
    srv = ServerProcess(["--model", "builtin:tiny-char"], port=free_port(), log_path=log, env=ONE_THREAD)
    yield srv
    srv.stop()


def start_training(out: Path, url: str, *overrides: str) -> subprocess.Popen:
    # A plain `python train.py` with no launcher variables: the trainer makes itself a world of one.
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, **ONE_THREAD}
    cmd = [sys.executable, "train.py", "--config", "configs/demo.yaml", f"ref.url={url}", "algo.beta=0.01",
           f"train.output_dir={out}", "rollout.prompts_per_step=4", "rollout.num_generations=4",
           "logging.progress_bar=false", "logging.plot=false", *overrides]
    out.mkdir(parents=True)
    with open(out.parent / "train.log", "w") as log:  # a file, not a pipe: a full pipe would block the trainer
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out: Path, timeout: float) -> str:
    """Wait for the trainer; its combined output."""
    proc.wait(timeout)
    return (out.parent / "train.log").read_text(errors="replace")


def wait_for_steps(out: Path, proc: subprocess.Popen, n: int) -> int:
    """Lines in metrics.jsonl once it has ``n``; fails at once if training exits, and after STEP_S per step."""
    path = out / "metrics.jsonl"
    seen, deadline = -1, 0.0
    while True:
        assert proc.poll() is None, f"training exited early ({proc.returncode}):\n{finish(proc, out, 1)[-3000:]}"
        lines = len(path.read_text().splitlines()) if path.exists() else 0
        if lines >= n:
            return lines
        if lines != seen:  # progress: a new step restarts the clock
            seen, deadline = lines, time.monotonic() + STEP_S
        assert time.monotonic() < deadline, f"training hung: no step for {STEP_S:g} s after step {lines} (waiting for {n})"
        time.sleep(0.02)


def test_server_restarted_within_the_retry_window(server, tmp_path):
    out, steps = tmp_path / "run", 16
    # the trainer starts first and waits for the server (ref.startup_wait), then survives its restart
    train = start_training(out, server.url, f"train.max_steps={steps}", f"ref.retry_window={SERVER_S:g}",
                           f"ref.startup_wait={SERVER_S:g}")
    server.start(timeout=SERVER_S)
    done_at_kill = wait_for_steps(out, train, 2)
    server.kill()
    server.start(timeout=SERVER_S)  # seconds of imports and loading: the trainer meets a dead server meanwhile
    log = finish(train, out, LAUNCH_S)
    assert train.returncode == 0, log[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "every step exactly once"
    assert done_at_kill < steps, "the server must die while training runs"
    assert sum(r["ref/retries"] for r in rows) >= 1, "the trainer retried through the outage"
    # a request a step for the log-probs; step 1 also the pre-flight check's top-k (logging.preflight)
    assert all(r["ref/requests"] == 1 + (r["step"] == 1) and r["ref/bytes_sent"] > 0 and r["ref/latency"] > 0
               for r in rows)


def test_server_gone_for_good_stops_training_with_a_clear_error(server, tmp_path):
    if server.proc is None or server.proc.poll() is not None:
        server.start(timeout=SERVER_S)
    out = tmp_path / "run"
    # save_every far away: issue 42, item 14: the stop saved nothing, so up to save_every - 1 steps were lost
    train = start_training(out, server.url, "train.max_steps=500", "train.save_every=400", "ref.retry_window=3")
    wait_for_steps(out, train, 3)
    assert latest_checkpoint(out) is None
    server.kill()
    log = finish(train, out, LAUNCH_S)
    assert train.returncode == 1, log[-3000:]
    assert f"reference error: reference server at {server.url}/v1/logprobs is unavailable" in log
    assert "python ref_client.py" in log and "ref.retry_window=3" in log
    # the outage was said while it lasted, not only at its end (issue 42, item 14)
    assert f"reference server at {server.url}/v1/logprobs: no answer" in log and "retry 1, for up to" in log
    assert log.index("retry 1, for up to") < log.index("reference error:")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < 500
    ckpt = latest_checkpoint(out)
    step = int(ckpt.name.split("-")[1])
    assert step == len(rows) and not list(ckpt.parent.glob(".tmp-*"))  # the last finished step, saved at the stop
    assert f"saved the last finished step before stopping: {ckpt}" in log
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert model.config.vocab_size == len(tok)
