"""Step-time outliers: the running-median watch names the phase that grew, and the collector's pauses are timed."""

from __future__ import annotations

import gc

from grpo.training.steptime import GcTimer, OutlierWatch


def _step(gen: float, train: float, ref: float = 0.1) -> dict[str, float]:
    return {"time/generation": gen, "time/train": train, "time/reference": ref, "time/step": gen + train + ref,
            "loss": 0.0}


def test_outlier_names_the_phase_that_grew(capsys):
    w = OutlierWatch(factor=1.5, warmup=3)
    steps = [_step(1.0, 0.5), _step(1.1, 0.5), _step(0.9, 0.6), _step(1.0, 0.5)]
    assert [w.check(i, m) for i, m in enumerate(steps)] == [None] * 4
    assert all(m["time/outlier"] == 0.0 for m in steps)
    # 1.4x the median (1.6 s): not an outlier; then the train phase triples: 2.8 s > 1.5 x 1.6 s
    assert w.check(4, _step(1.0, 1.14)) is None
    slow = _step(1.0, 1.7)
    assert w.check(5, slow) == "time/train" and slow["time/outlier"] == 1.0
    assert w.outliers == [(5, "time/train", slow["time/step"] / 1.6)]
    assert "time/train grew the most" in capsys.readouterr().err
    # generation is the one that grew here
    assert w.check(6, _step(2.9, 0.5)) == "time/generation"


def test_outlier_lines_are_rate_limited_and_count_what_they_left_out(capsys):
    """Issue 42, item 25: 33 outlier lines in a 150-step CPU run, each breaking the progress bar."""
    w = OutlierWatch(factor=1.5, warmup=3, quiet_steps=50)
    flagged = 0
    for i in range(150):
        flagged += w.check(i, _step(1.0, 0.5) if i % 4 else _step(1.0, 5.0)) is not None
    lines = capsys.readouterr().err.strip().splitlines()
    assert flagged == len(w.outliers) > 30  # every outlier is still flagged in the metrics
    assert len(lines) == 3 and lines[0].startswith("step 4:"), lines  # steps 4, 56 and 108
    assert lines[1].startswith("step 56:") and "(12 more outlier steps since step 4" in lines[1]


def test_first_steps_are_warm_up():
    w = OutlierWatch(factor=1.5, warmup=3)
    assert w.check(0, _step(1.0, 0.5)) is None
    assert w.check(1, _step(10.0, 0.5)) is None  # only 1 step before it: no median yet


def test_gc_timer_sees_a_collection():
    t = GcTimer()
    try:
        junk = [[i] for i in range(200_000)]
        for a in junk:
            a.append(a)  # cycles: the collector has to walk them
        del junk
        t.pop()
        gc.collect()
        assert t.pop() > 0
        assert t.pop() == 0.0
    finally:
        t.close()
    assert t._callback not in gc.callbacks


def test_memory_peaks_per_phase_and_device_allocations(monkeypatch):
    """The CUDA allocator's counters through fakes (no GPU here): each phase's peak is the peak since the previous
    call, and its device allocations are the counter's growth over that phase (a cumulative counter that a
    reset of the peaks leaves alone)."""
    import torch

    from grpo.training.steptime import MemoryPeaks

    state = {"peak": 0, "allocs": 0}

    def alloc(peak: int, calls: int) -> None:  # what a phase does to the allocator
        state["peak"] = max(state["peak"], peak)
        state["allocs"] += calls

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_device_alloc": state["allocs"]})
    m = MemoryPeaks(torch.device("cuda"))
    alloc(3 * 2**30, 40)  # before the step (model loading): counts towards the run's peak only
    m.begin()
    alloc(2**30, 5)
    m.end("generate")
    alloc(2 * 2**30, 0)
    m.end("logprobs")
    alloc(2**29, 300)
    m.end("train")
    assert m.pop() == {"memory/generate_gib": 1.0, "memory/generate_device_allocs": 5.0,
                       "memory/logprobs_gib": 2.0, "memory/logprobs_device_allocs": 0.0,
                       "memory/train_gib": 0.5, "memory/train_device_allocs": 300.0}
    assert m.run_peak == 3 * 2**30 and m.pop() == {}
    off = MemoryPeaks(torch.device("cpu"))  # nothing off CUDA
    off.begin()
    off.end("train")
    assert off.pop() == {}
