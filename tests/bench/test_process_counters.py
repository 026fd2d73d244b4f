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


def test_the_hosts_busy_and_stolen_shares_over_a_run(tmp_path) -> None:
    """``/proc/stat``'s first line before and after: of 1,000 ticks, 600 idle or waiting and
    50 stolen make a 40 % busy host with 5 % of its CPU time taken by another tenant."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\\ncpu0 1 2 3\\n")
    counters = counters_mod.ProcessCounters(torch.device("cpu"), stat_path=str(stat))
    try:
        base = counters.begin()
        stat.write_text("cpu  350 0 200 1250 150 0 0 50 0 0\\n")
        got = counters.since(base)
    finally:
        counters.close()
    assert got["host_busy_share"] == pytest.approx(0.4)
    assert got["host_steal_share"] == pytest.approx(0.05)
    assert got["cpu_s"] >= 0.0
    probe = load_bench("machine_probe")
    assert probe.host_cpu_ticks(str(tmp_path / "missing")) is None
    assert probe.host_shares((10, 5, 0), (10, 5, 0)) == {}  # no ticks between: no shares


def test_gpu_clocks_sampled_over_a_run() -> None:
    """A run's SM clock (least, mean) and throttle reasons OR-ed over its samples, from a
    reader (NVML's on a GPU); a reader with nothing to say leaves no keys."""
    probe = load_bench("machine_probe")
    readings = itertools.cycle([(1980, 0), (1410, 0x4), None, (1980, 0x20)])
    clocks = probe.GpuClocks(lambda: next(readings), interval_s=0.001)
    counters = counters_mod.ProcessCounters(torch.device("cpu"), gpu_clocks=clocks)
    try:
        base = counters.begin()
        while len(clocks._samples) < 6:
            pass
        got = counters.since(base)
    finally:
        counters.close()
    assert got["sm_clock_min_mhz"] == 1410 and 1410 < got["sm_clock_mean_mhz"] < 1980
    assert got["throttle_reasons"] == 0x24 and got["clock_samples"] >= 6
    silent = probe.GpuClocks(lambda: None, interval_s=0.001)
    silent.start()
    assert silent.stop() == {} and silent.stop() == {}  # stopped twice: still nothing
