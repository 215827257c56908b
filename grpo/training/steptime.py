"""Step-time outliers: a step slower than ``factor`` x the running median of the steps before it is named,
with the phase (generation, reward, reference, train, weight sync, Python's garbage collector...) that grew
the most against its own median.

The garbage collector's pauses are timed through ``gc.callbacks`` (``time/gc``): a full collection over a
large heap of tensors' Python objects is one candidate cause of a slow step that a CPU can show.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from typing import Optional

import torch

from grpo.foundation.console import say


class MemoryPeaks:
    """``memory/<phase>_gib``: the most CUDA memory allocated during each phase of a step (``generate``,
    ``logprobs``: the old-policy and reference passes, ``train``: the training passes, the optimizer step and
    the engine's weight sync), in GiB; and ``memory/<phase>_device_allocs``: how many times the caching allocator
    asked the device for memory in that phase (``cudaMalloc`` calls; each costs host time and some synchronise:
    a phase that pays them every step is working against an emptied cache). Nothing off CUDA. The allocator's
    counters are host reads (no device sync). Each phase resets torch's peak counter, so the whole run's peak is
    ``run_peak`` (bytes), which also keeps what happened between steps (evaluation, checkpoints)."""

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self.run_peak = 0
        self.allocs = 0  # the allocator's device allocations so far (num_device_alloc)
        self.metrics: dict[str, float] = {}

    def _read(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_peak = max(self.run_peak, peak)
        return peak

    def _allocs_since(self) -> int:
        """Device allocations since the last call (the counter is cumulative: a reset of the peaks keeps it)."""
        now = int(torch.cuda.memory_stats(self.device).get("num_device_alloc", 0))
        since, self.allocs = now - self.allocs, now
        return since

    def begin(self) -> None:
        """A step starts: what came before it counts towards ``run_peak`` only."""
        if self.device is not None:
            self._read()
            self._allocs_since()

    def end(self, phase: str) -> None:
        """The phase that began at the previous call ends now."""
        if self.device is not None:
            self.metrics[f"memory/{phase}_gib"] = self._read() / 2**30
            self.metrics[f"memory/{phase}_device_allocs"] = float(self._allocs_since())

    def pop(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out


def freeze_what_came_before() -> None:
    """Take the objects that exist before the first Trainer of a process (the imported libraries: ~380k objects
    after torch, transformers and DeepSpeed) out of the collector's full passes, for good: a full pass then
    walks only what was made since (the Trainer's model, data and each step's objects: ~30k with the tiny model,
    10 ms here, against 140 ms for the whole heap), so no step pays for walking the libraries.

    Once per process: the objects are collected first (what is garbage now is freed, not frozen), then frozen and
    never unfrozen. A Trainer's own objects are never frozen, so a closed Trainer's memory, cycles included, is
    freed by the collector as usual, and a second Trainer in the process (a notebook, a test) starts without
    walking the libraries again. (A flag, not ``gc.get_freeze_count()``, which walks the frozen list: 33 ms.)"""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


_FROZEN = False  # freeze_what_came_before has run in this process


class GcTimer:
    """Seconds spent in Python's garbage collector since the last ``pop`` (all generations)."""

    def __init__(self):
        self.seconds = 0.0
        self._t0: Optional[float] = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def pop(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class OutlierWatch:
    """Keeps the last ``window`` steps' ``time/*`` metrics; ``check`` flags a step whose ``time/step`` passes
    ``factor`` x the median of those before it (after ``warmup`` steps: the first ones compile and warm up)."""

    def __init__(self, factor: float = 1.5, window: int = 50, warmup: int = 3, verbose: bool = True,
                 quiet_steps: int = 50):
        self.factor, self.warmup, self.verbose = factor, warmup, verbose
        self.history: deque[dict[str, float]] = deque(maxlen=window)
        self.outliers: list[tuple[int, str, float]] = []  # (step, phase, step time / median)
        # at most one line per ``quiet_steps`` steps (each breaks the progress bar); the next line counts the
        # outliers not printed; every one is in the metrics (time/outlier)
        self.quiet_steps = quiet_steps
        self._printed_at: Optional[int] = None
        self._unprinted = 0

    def check(self, step: int, metrics: dict[str, float]) -> Optional[str]:
        """Returns the phase that made this step an outlier (and sets ``metrics['time/outlier']``), else None."""
        times = {k: v for k, v in metrics.items() if k.startswith("time/") and k != "time/outlier"}
        phase = None
        if len(self.history) >= self.warmup and "time/step" in times:
            median = statistics.median(h["time/step"] for h in self.history)
            if times["time/step"] > self.factor * median:
                excess = {k: v - statistics.median(h.get(k, 0.0) for h in self.history)
                          for k, v in times.items() if k != "time/step"}
                phase = max(excess, key=excess.get) if excess else "time/step"
                ratio = times["time/step"] / max(median, 1e-12)
                self.outliers.append((step, phase, ratio))
                if self.verbose and (self._printed_at is None or step - self._printed_at >= self.quiet_steps):
                    more = (f" ({self._unprinted} more outlier steps since step {self._printed_at}: "
                            f"time/outlier in the metrics)" if self._unprinted else "")
                    say(f"step {step}: {times['time/step']:.2f} s is {ratio:.1f}x the running median "
                        f"({median:.2f} s); {phase} grew the most (+{excess.get(phase, 0.0):.2f} s){more}", err=True)
                    self._printed_at, self._unprinted = step, 0
                else:
                    self._unprinted += 1
        metrics["time/outlier"] = 1.0 if phase else 0.0
        self.history.append(times)
        return phase
