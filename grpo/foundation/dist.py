"""Small distributed helpers that also work in a single process without torch.distributed."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as tdist


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_threads(cuda: bool, local_ranks: int = 1) -> int:
    """Set and return torch's CPU (intra-op) threads for a process whose model is on CUDA (``cuda``) or on the CPU.

    ``OMP_NUM_THREADS``, when set, decides (nothing is changed). On CUDA the host only encodes, packs and copies
    small tensors: one thread (what torchrun sets for each of several processes). With one thread per core, the pool woken for
    each of those small ops after the host waited on the GPU made the reference server's HTTP path 17.7 ms
    instead of 4.4 ms on a 16-core H200 host (docs/results.md). On the CPU, ranks on one machine split its cores.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    torch.set_num_threads(1 if cuda else max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    return torch.get_num_threads()


def default_single_process_env() -> bool:
    """Make a plain ``python train.py`` one rank of a world of one.

    Without a launcher none of RANK/WORLD_SIZE/MASTER_* is set and DeepSpeed falls back to MPI
    discovery (which needs mpi4py and an MPI job). When no launcher variable and no MPI/SLURM job is
    present, set the single-process values instead; a partial set is left alone so DeepSpeed reports it.
    Returns whether it set anything.
    """
    if any(k in os.environ for k in _LAUNCHER_VARS + _MPI_VARS):
        return False
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return True


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return tdist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def _all_reduce(x: torch.Tensor, op) -> torch.Tensor:
    if not is_initialized() or world_size() == 1:
        return x.clone()
    y = x.detach().clone()
    tdist.all_reduce(y, op=op)
    return y


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; the input is left alone). Identity in one process."""
    return _all_reduce(x, tdist.ReduceOp.SUM)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks (a copy). Identity in one process."""
    return _all_reduce(x, tdist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on at least one rank (collective when distributed)."""
    if not is_initialized() or world_size() == 1:
        return flag
    return bool(all_reduce_max(torch.tensor([float(flag)]))[0] > 0)


def all_gather_object(obj: object) -> list:
    if not is_initialized() or world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    if not is_initialized() or world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if is_initialized() and world_size() > 1:
        tdist.barrier()


def shutdown(wait: bool = True) -> None:
    """Wait for every rank (``wait``), then tear the process group down while the interpreter is still whole.

    Left to interpreter exit, the communication threads of a ZeRO-3 run sometimes died unjoined
    ("terminate called without an active exception", SIGABRT) after all the work had finished.

    Through DeepSpeed when it set the group up: it also drops the groups it cached (its clone of the world),
    which a later run in this process (a notebook's second ``train.main``) would otherwise use, destroyed."""
    if is_initialized():
        if wait:
            barrier()
        ds_comm = sys.modules.get("deepspeed.comm.comm")  # loaded only where DeepSpeed runs; this layer never imports it
        if getattr(ds_comm, "cdb", None) is not None:
            ds_comm.destroy_process_group()
        else:
            tdist.destroy_process_group()
