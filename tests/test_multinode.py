"""More than one node: two simulated nodes of one CPU rank each on loopback, launched the way a cluster
without ssh is (`deepspeed --hostfile H --no_ssh --num_nodes 2 --node_rank N --master_addr A`), give the
same metrics as one node with two ranks, bit for bit (loss and grad_norm included, so the same step gradient;
that gradient's independence of the layout, aggregation by aggregation, is tests/test_distributed.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.foundation.dist import free_port
from grpo.training.metrics import read_metrics
from tests.conftest import ROOT, run_deepspeed
from tests.patience import LAUNCH_S

pytestmark = pytest.mark.slow

RUN = ["--config", "configs/demo.yaml", "logging.progress_bar=false", "logging.plot=false", "algo.beta=0",
       "rollout.prompts_per_step=4", "rollout.num_generations=4", "train.max_steps=3", "reward_pool.num_workers=0"]
TIMING = ("time/", "tokens_per_sec")


def is_timing(key: str) -> bool:
    """Wall-clock metrics differ between any two runs: the time/* phases, throughput, reward latencies."""
    return key.startswith(TIMING) or key.endswith("/latency")


def run_two_nodes(args: list[str], script: str, tmp: Path) -> None:
    hostfile = tmp / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")  # two names for this machine: two "nodes"
    exe = Path(sys.executable).with_name("deepspeed")
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([str(exe), "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank",
                               str(node), "--master_addr", "127.0.0.1", "--master_port", port, script, *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=LAUNCH_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}\n{out[-5000:]}"


def test_two_nodes_equal_two_ranks_on_one_node(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same threads per rank on both layouts
    run_two_nodes([*RUN, f"train.output_dir={tmp_path / 'nodes'}"], "train.py", tmp_path)
    run_deepspeed([*RUN, f"train.output_dir={tmp_path / 'ranks'}"], 2, launcher="torchrun")  # the nodes: deepspeed
    nodes, ranks = read_metrics(tmp_path / "nodes" / "metrics.jsonl"), read_metrics(tmp_path / "ranks" / "metrics.jsonl")
    assert len(nodes) == len(ranks) == 3
    for a, b in zip(nodes, ranks):
        assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
    # one writer: rank 0 of node 0 wrote the checkpoint and the metrics, once
    assert (tmp_path / "nodes" / "checkpoints" / "step-3" / "config.json").is_file()

