"""bench/gpu_gaps.py: the GPU's idle gaps in a Chrome trace, and the host ranges over them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from helpers import load_bench


def _trace() -> dict:
    """Two streams: kernels at [0, 100] and [50, 150] overlap; a gap to 400 (the next kernel
    launched at 300, late by 150, while "plan" ran 160-380); a 10 us gap; one at 700 launched
    early (at 100: the GPU waited on something else)."""

    def kernel(name, ts, dur, corr, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "stream": stream}}  # fmt: skip

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts,
                "dur": 5, "args": {"correlation": corr}}  # fmt: skip

    return {"traceEvents": [
        kernel("a", 0, 100, 1), kernel("b", 50, 100, 2, stream=9), kernel("c", 400, 100, 3),
        kernel("d", 510, 90, 4), kernel("e", 700, 50, 5),
        launch(-10, 1), launch(0, 2), launch(300, 3), launch(400, 4), launch(100, 5),
        {"ph": "X", "cat": "user_annotation", "name": "plan", "ts": 160, "dur": 220},
        {"ph": "X", "cat": "user_annotation", "name": "collect", "ts": 650, "dur": 20},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},  # not an interval
    ]}  # fmt: skip


def test_gaps_split_by_host_lateness_and_range() -> None:
    gg = load_bench("gpu_gaps")
    out = gg.kernel_gaps(_trace(), min_gap_us=20)
    assert out["span_ms"] == pytest.approx(0.750)
    assert out["busy_ms"] == pytest.approx((150 + 100 + 90 + 50) / 1e3)
    assert out["idle_ms"] == pytest.approx((250 + 10 + 100) / 1e3)
    assert out["gaps"] == 2  # the 10 us one is below the threshold
    assert out["gaps_ms"] == pytest.approx(0.350)
    assert out["gaps_host_late_ms"] == pytest.approx(0.250)  # only the first was issued late
    first, second = out["longest"]
    assert (first["before"], first["after"], first["us"]) == ("b", "c", 250)
    assert first["launch_late_us"] == pytest.approx(150)
    assert first["host"] == {"plan": 220}
    assert (second["before"], second["after"], second["launch_late_us"]) == ("d", "e", -500)
    assert second["host"] == {"collect": 20}
    assert out["gaps_ms_by_host_range"] == {"plan": 0.25, "collect": 0.1}
    assert "host late in 0.2)" in gg.format_gaps(out)


def test_window_and_no_device_work() -> None:
    gg = load_bench("gpu_gaps")
    out = gg.kernel_gaps(_trace(), window=(300, 800))
    assert out["span_ms"] == pytest.approx(0.350)  # kernels c, d and e only
    assert out["gaps"] == 1
    with pytest.raises(ValueError, match="no GPU work"):
        gg.kernel_gaps(_trace(), window=(2000, 3000))


def test_load_reads_gzip(tmp_path: Path) -> None:
    gg = load_bench("gpu_gaps")
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(json.dumps(_trace()).encode()))
    (tmp_path / "t.json").write_text(json.dumps(_trace()))
    assert gg.load_trace(tmp_path / "t.json.gz") == gg.load_trace(tmp_path / "t.json")


class _Thing:
    def work(self, x: int) -> int:
        return x + 1

    def pieces(self, n: int):
        for _ in range(n):
            yield
        return "done"


def test_annotated_ranges_reach_the_trace_and_are_undone(tmp_path: Path) -> None:
    """Each call of a wrapped method, and each resumption of a wrapped generator method, is a
    range in the profiler's trace; the methods are restored after the block."""
    gg = load_bench("gpu_gaps")
    from torch.profiler import ProfilerActivity, profile

    original = _Thing.__dict__["work"]
    thing = _Thing()
    with (
        profile(activities=[ProfilerActivity.CPU]) as prof,
        gg.annotated([(_Thing, "work"), (_Thing, "pieces")]),
    ):
        assert thing.work(1) == 2
        gen = thing.pieces(2)
        next(gen), next(gen)
        with pytest.raises(StopIteration) as stop:
            next(gen)
        assert stop.value.value == "done"
        torch.ones(2).add_(1)
    assert _Thing.__dict__["work"] is original
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    names = [e["name"] for e in gg.load_trace(path)["traceEvents"]
             if e.get("cat") == "user_annotation"]  # fmt: skip
    assert names.count("_Thing.work") == 1
    assert names.count("_Thing.pieces") == 3  # two pauses and the return


class _Child(_Thing):
    pass


def test_annotated_an_inherited_method_is_removed_again() -> None:
    """Wrapping a method the class inherits puts the wrapper on the class; afterwards the class
    inherits the method again (nothing left behind)."""
    gg = load_bench("gpu_gaps")
    with gg.annotated([(_Child, "work")]):
        assert "work" in _Child.__dict__ and _Child().work(2) == 3
    assert "work" not in _Child.__dict__ and _Child().work(2) == 3
