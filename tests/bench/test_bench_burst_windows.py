"""bench/burst_windows.py: each run's burst behind its TTFT p99, read from the TTFT anatomy's
window (the lines bench/ttft_anatomy.py writes), beside the run's TTFT p99."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_bench


def _window(fused: bool) -> dict:
    """A burst's window as bench/ttft_anatomy.py writes it (its own tests pin these lines):
    "early" queued 12 ms after it arrived, then a 4,801-token backlog planned into one prompt
    step, fused or beside the decode stream."""
    read = "wait 10.4 ms, queued 4801 tok, room, running 9/64, decode + decode ahead busy"
    step = "mixed 2007" if fused else "prefill 1998"
    return {
        "slowest": ["slow"], "elsewhere": [], "span_ms": 61.0,
        "arrivals": ["-20.0 arrive early 1000 tok (TTFT 32.0 ms, queued +12.0 ms)",
                     "+0.0 arrive slow 1000 tok (TTFT 61.0 ms, queued +0.0 ms)"],
        "prompt_steps": ["-40.0..+10.0 prefill 1628 tok ends early",
                         f"+11.0..+60.0 {step} tok ends slow [{read}]"],
        "ticks": [], "loop_late": ["-19.0 loop 13.9 ms late", "+20.0 loop 4.0 ms late"],
    }  # fmt: skip


def test_burst_rows_from_result_files(tmp_path: Path) -> None:
    bw = load_bench("burst_windows")
    rows = [
        {"rate": 14.0, "mode": "off", "ttft_p99_ms": 101.0,
         "ttft_anatomy": {"window": _window(fused=True)}},
        {"rate": 14.0, "mode": "policy", "ttft_p99_ms": 121.0,
         "ttft_anatomy": {"window": _window(fused=False)}},
        {"rate": 26.0, "mode": "off", "ttft_p99_ms": 140.0,
         "ttft_anatomy": {"window": _window(fused=False)}},  # another rate
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
