"""Shared test helpers: the tiny model, free ports, and the DeepSpeed launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.foundation.dist import free_port
from tests.patience import LAUNCH_S

ROOT = Path(__file__).resolve().parent.parent

# Under pytest-xdist (make test: 2 workers on CI's 2 cores) every worker and every process it starts (the
# deepspeed ranks, servers, scripts) would run torch's default of one thread per core: 2 workers x 2
# threads spinning on 2 cores made the launched runs 2-3x slower (gpg's learning check: 191 s against
# 58 s with one thread). One thread each, unless the caller chose.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def deepspeed_cmd(num_ranks: int, script: str = "train.py") -> list[str]:
    exe = Path(sys.executable).with_name("deepspeed")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return launcher + ["--num_gpus", str(num_ranks), "--master_port", str(free_port()), script]


def torchrun_cmd(num_ranks: int, script: str = "train.py") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_ranks), "--master_port",
            str(free_port()), script]


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_deepspeed(args: list[str], num_ranks: int = 2, script: str = "train.py", check: bool = True,
                  launcher: str = "deepspeed") -> subprocess.CompletedProcess:
    """Launch ``script`` on ``num_ranks`` ranks from the repo root; fail with its output (hung: after LAUNCH_S).
    ``launcher``: ``deepspeed`` (the command users run: ``deepspeed --num_gpus N``) or ``torchrun``
    (``python -m torch.distributed.run --nproc_per_node N``, which users may run instead). Tests whose subject is
    the ranks' work, not the command, take torchrun: one process importing torch, against the deepspeed runner's
    two importing DeepSpeed (1.3 s against 5.0 s a launch on the 2-core machine). One rank runs as a plain
    ``python script`` (a world of one, as a user's ``python train.py``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if num_ranks == 1:
        cmd = [sys.executable, "-u", script] + args
        env = {k: v for k, v in env.items() if k not in LAUNCHER_VARS}
    else:
        cmd = {"deepspeed": deepspeed_cmd, "torchrun": torchrun_cmd}[launcher](num_ranks, script) + args
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd[0]} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    if num_ranks > 1:  # DeepSpeed's CPU shm all-reduce op is not built (init_distributed)
        port = cmd[cmd.index("--master_port") + 1]
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), "a rank made a /dev/shm buffer"
    return proc


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny model and tokenizer written as an HF folder."""
    from grpo.foundation.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny") / "model")


LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def launcher_env_kept():
    """A test that builds a trainer in this process without ``single_rank_env`` makes it a world of one
    (grpo.foundation.dist.default_single_process_env sets MASTER_PORT and the rest for good, as a notebook's
    ``grpo.train`` does): the variables go back after the test, so that a later test's child process (a script,
    train.py) does not inherit the port this process's own process group listens on (EADDRINUSE)."""
    before = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    restore_env(before)


def restore_env(old: dict) -> None:
    """Put the environment variables back as ``old`` has them (None: unset)."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def single_rank_env():
    """The environment of a one-rank DeepSpeed world, for a Trainer built inside the test process."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    restore_env(old)


# The suite's slowest files, slowest first (their time in the main suite on the 2-core machine, 2026-11-28: 88 s
# down to 4.7 s; the other files take under 4 s each). pytest-xdist gives a file to whichever worker is free,
# in the order of the collection: the long ones started first leave the short ones to even out the two workers'
# ends (longest first). `make test` passes --no-loadscope-reorder, or xdist would order the files by their
# number of tests instead.
SLOWEST_FIRST = ["test_distributed.py", "test_gpu_check.py", "test_algos_train.py", "test_ref_server.py",
                 "test_sandbox_isolation.py", "test_distill.py", "test_distill_learning.py",
                 "test_algos_losses_train.py", "test_agents_train.py", "test_ref_fault.py", "test_layers.py",
                 "test_static_engine.py", "test_recipes.py", "test_code_tests.py", "test_reward_learning.py",
                 "test_api.py", "test_ref_client.py", "test_bench_profile.py", "test_algos_hooks.py",
                 "test_reward_server.py", "test_bench_ref_http.py", "test_multiturn.py", "test_reward_pool.py",
                 "test_distill_topk.py", "test_sandbox.py", "test_lora.py", "test_registry.py", "test_logprobs.py",
                 "test_eval_script.py", "test_reward_remote.py"]


def pytest_collection_modifyitems(config, items):
    """The slowest files first (SLOWEST_FIRST; a stable sort: the rest, and each file's tests, keep their order).
    Tests marked ``gpu`` need CUDA: deselected (reported as such) where torch sees no GPU."""
    import torch

    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
