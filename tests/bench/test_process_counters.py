"""bench/process_counters.py: a run's share of the allocator's driver calls and of Python's
garbage collections."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from helpers import load_bench

counters_mod = load_bench("process_counters")


def test_collections_and_their_pauses_on_a_fake_clock() -> None:
    ticks = itertools.count(start=0.0, step=0.004)  # every reading 4 ms after the last
    counters = counters_mod.ProcessCounters(torch.device("cpu"), clock=lambda: next(ticks))
    try:
        base = counters.begin()
        gc.collect(0)
        gc.collect(2)
        got = counters.since(base)
    finally:
        counters.close()
    assert counters._on_gc not in gc.callbacks
    assert got["gc_collections_gen0"] >= 1 and got["gc_collections_gen2"] >= 1
    n = sum(got[f"gc_collections_gen{g}"] for g in range(3))
    assert got["gc_pause_ms"] == pytest.approx(4.0 * n)  # one clock step per collection
    assert got["gc_max_pause_ms"] == pytest.approx(4.0)
    assert "cuda_mallocs" not in got and "reserved_gib" not in got  # a CPU run


def test_allocator_counts_are_a_runs_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = {"num_device_alloc": 10, "num_device_free": 2, "num_alloc_retries": 0,
             "num_sync_all_streams": 1, "allocated_bytes.all.current": 7}  # fmt: skip
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: dict(stats))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * 2**30)
    counters = counters_mod.ProcessCounters(torch.device("cuda"))
    try:
        base = counters.begin()
        stats.update(num_device_alloc=14, num_alloc_retries=1)
        got = counters.since(base)
    finally:
        counters.close()
    assert got["cuda_mallocs"] == 4 and got["cuda_frees"] == 0 and got["alloc_retries"] == 1
    assert got["alloc_stream_syncs"] == 0 and got["reserved_gib"] == 3.0
    assert "allocated_bytes.all.current" not in got
