"""One torch.profiler run in a few figures, for scripts/benchmarks/gpu_check.py's profile stages and bench.py's
``--profile`` (the same summary for our trainer and TRL's)."""

from __future__ import annotations

# host waits: CUDA runtime calls that block the host, and the aten ops that make one (on any device: counted on CPU too)
CUDA_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")


def profile_summary(prof, cuda: bool, per: float = 1.0, suffix: str = "") -> dict:
    """A torch.profiler run's figures divided by ``per`` (tokens; 1: the whole run), keys ending in ``suffix``:
    device ms and kernels (CPU ops on CPU), ops that make the host wait (and, on CUDA, the runtime's synchronize
    calls), the 12 costliest kernels (device time) and the 8 costliest host ops (self CPU time: where a
    launch-bound pass's time goes)."""
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [e for e in events if getattr(e, attr, 0) > 0 and (not cuda or e.device_type.name == "CUDA")]
    host = [e for e in events if e.self_cpu_time_total > 0 and e.device_type.name == "CPU"]
    res = {f"device_ms{suffix}": sum(getattr(e, attr) for e in kernels) / 1000 / per,
           f"kernels{suffix}": sum(e.count for e in kernels) / per,
           f"sync_ops{suffix}": sum(e.count for e in events if e.key in SYNC_OPS) / per}
    if cuda:
        res[f"cuda_waits{suffix}"] = sum(e.count for e in events if e.key in CUDA_WAITS) / per
    res["top"] = [{"name": e.key[:90], f"ms{suffix}": getattr(e, attr) / 1000 / per, f"calls{suffix}": e.count / per}
                  for e in sorted(kernels, key=lambda e: -getattr(e, attr))[:12]]
    res["host_top"] = [{"name": e.key[:90], f"ms{suffix}": e.self_cpu_time_total / 1000 / per,
                        f"calls{suffix}": e.count / per}
                       for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:8]]
    return res


def start(cuda: bool):
    """A torch.profiler run started now (CPU ops, and CUDA kernels on a GPU): stop it with :func:`finish`."""
    import time

    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    prof.start()
    prof.t0 = time.perf_counter()
    return prof


def finish(prof, cuda: bool) -> dict:
    """Stop ``prof`` once the device has done its work: the wall ms since :func:`start` and :func:`profile_summary`."""
    import time

    import torch

    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - prof.t0
    prof.stop()
    return {"wall_ms": 1000 * wall, **profile_summary(prof, cuda)}
