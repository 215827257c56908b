"""grpo.foundation.dist: a plain `python train.py` becomes a world of one; launcher and MPI jobs are left alone."""

import socket

import pytest

from grpo.foundation import dist

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def bare_env(monkeypatch):
    for k in LAUNCHER + dist._MPI_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_plain_process_gets_world_of_one(bare_env):
    assert dist.default_single_process_env() is True
    import os

    assert {k: os.environ[k] for k in LAUNCHER if k != "MASTER_PORT"} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:  # the chosen port is free
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("var", ["RANK", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"])
def test_launcher_or_mpi_job_left_alone(bare_env, var):
    import os

    bare_env.setenv(var, "7")
    assert dist.default_single_process_env() is False
    assert os.environ[var] == "7"
    assert all(k not in os.environ for k in LAUNCHER if k != var)


def test_host_threads_one_on_cuda_a_share_on_cpu_and_omp_num_threads_decides(monkeypatch):
    import os

    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: 8)
        assert dist.host_threads(cuda=True) == 1 == torch.get_num_threads()
        assert dist.host_threads(cuda=False, local_ranks=2) == 4 == torch.get_num_threads()
        assert dist.host_threads(cuda=False, local_ranks=16) == 1  # never 0
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert dist.host_threads(cuda=True) == 3 == torch.get_num_threads()  # the user's setting stays
    finally:
        torch.set_num_threads(before)
