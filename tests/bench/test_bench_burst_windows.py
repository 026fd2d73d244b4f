"""bench/burst_windows.py: each run's burst behind its TTFT p99, read from the TTFT anatomy's
window (the lines bench/ttft_anatomy.py writes), beside the run's TTFT p99."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_bench


def _window(ana, loadgen, fused: bool) -> dict:
    """A burst: "early" queued 12 ms after it arrived, then a 4,801-token backlog planned into
    one prompt step, fused or beside the decode stream."""
    log = ana.StepLog()
    read = "wait 10.4 ms, queued 4801 tok, room, running 9/64, decode + decode ahead busy"
    log.steps = [
        ana.FoldedStep("prefill", -0.040, 0.010, 1628, [("early", -0.008, -0.040)]),
        ana.FoldedStep("mixed" if fused else "prefill", 0.011, 0.060, 1998 + 9 * fused,
                       [("slow", 0.0, 0.011)], fuse=read),
    ]  # fmt: skip
    log.loop_lags = [(-0.019, 0.0139), (0.020, 0.004)]
    traces = []
    for rid, arrival, first in (("early", -0.020, 0.012), ("slow", 0.0, 0.061)):
        t = loadgen.Trace(rid, "long", 1000, 4, arrival)
        t.deltas.append((first, 1))
        traces.append(t)
    return ana.window(log, traces, k=1)


def test_burst_rows_from_result_files(tmp_path: Path) -> None:
    ana, loadgen = load_bench("ttft_anatomy"), load_bench("loadgen")
    bw = load_bench("burst_windows")
    if not ana.SAME_CLOCK:
        pytest.skip("the window needs the client's and the engine's clocks to be one")
    rows = [
        {"rate": 14.0, "mode": "off", "ttft_p99_ms": 101.0,
         "ttft_anatomy": {"window": _window(ana, loadgen, fused=True)}},
        {"rate": 14.0, "mode": "policy", "ttft_p99_ms": 121.0,
         "ttft_anatomy": {"window": _window(ana, loadgen, fused=False)}},
        {"rate": 26.0, "mode": "off", "ttft_p99_ms": 140.0,
         "ttft_anatomy": {"window": _window(ana, loadgen, fused=False)}},  # another rate
        {"rate": 14.0, "mode": "plain", "ttft_p99_ms": 99.0},  # no anatomy: not a row
    ]  # fmt: skip
    path = tmp_path / "mixed-x.json"
    path.write_text(json.dumps({"git_commit": "abc1234", "sweep": rows}))
    out = tmp_path / "burst.json"
    result = bw.main([str(path), "--rate", "14", "--out", str(out)])
    got = {r["mode"]: r for r in result["rows"]}
    assert set(got) == {"off", "policy"}
    for r in got.values():
        assert r["max_queued_late_ms"] == pytest.approx(12.0) and r["latest_queued"] == "early"
        assert r["loop_late"] == {"count": 2, "max_ms": 13.9, "sum_ms": pytest.approx(17.9)}
        assert r["git_commit"] == "abc1234" and r["slowest"] == ["slow"]
    assert got["off"]["steps"][1] == ("mixed", 2007, 10.4, 4801)
    assert (got["off"]["fused_steps"], got["off"]["unfused_burst_steps"]) == (1, 0)
    assert (got["policy"]["fused_steps"], got["policy"]["unfused_burst_steps"]) == (0, 1)
    assert got["policy"]["first_burst_wait_ms"] == 10.4  # the 1,628-token step read nothing
    assert bw.fuse_kind(got["policy"]) == "unfused" and bw.fuse_kind(got["off"]) == "fused"
    saved = json.loads(out.read_text())
    assert [r["ttft_p99_ms"] for r in saved["rows"]] == [101.0, 121.0]
    assert out.with_suffix(".png").is_file()


def test_a_window_without_fuse_reads_is_not_judged() -> None:
    """Windows written before the fuse reads were logged: unfused steps are unknown (None),
    not zero; a row without a window is skipped."""
    bw = load_bench("burst_windows")
    win = {"slowest": ["a"], "arrivals": ["+0.0 arrive a 10 tok (TTFT 50.0 ms)"],
           "prompt_steps": ["+1.0..+40.0 prefill 1998 tok ends a"]}  # fmt: skip
    row = bw.window_row({"mode": "off", "rate": 14.0, "ttft_p99_ms": 50.0,
                         "ttft_anatomy": {"window": win}})  # fmt: skip
    assert row["unfused_burst_steps"] is None and bw.fuse_kind(row) == "not logged"
    assert row["max_queued_late_ms"] is None and row["loop_late"] is None
    assert row["steps"] == [("prefill", 1998, None, None)]
    assert row["first_burst_wait_ms"] is None
    assert bw.window_row({"mode": "off", "rate": 14.0, "ttft_p99_ms": 50.0}) is None
