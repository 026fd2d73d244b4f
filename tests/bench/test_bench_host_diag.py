"""bench/host_diag.py: a tiny CPU sweep with every call counted as slow (threshold 0) records
the lanes' and engine's calls and the launches by lane, times every call (percentiles by method
and launch kind), writes its summary, and leaves the wrapped classes as they were."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench
from sweep_helpers import SWEEP_TINY

from verifypd.engine import speculative
from verifypd.engine.runner import ModelRunner
from verifypd.lanes.dispatcher import LaneDispatcher

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_host_diag_attributes_host_time_and_unwraps(tmp_path, monkeypatch) -> None:
    diag = load_bench("host_diag")
    monkeypatch.setattr(diag, "SLOW_S", 0.0)
    before = (
        LaneDispatcher.__dict__["_plan"],
        ModelRunner.__dict__["launch"],
        ModelRunner.__dict__["launch_iter"],
        speculative.chunked_catch_up,
    )
    args = [*SWEEP_TINY, "--modes", "policy", "--rates", "20", "--profiles", "hetero"]
    out = diag.main([*args, "--out", str(tmp_path), "--tag", "t"])
    after = (
        LaneDispatcher.__dict__["_plan"],
        ModelRunner.__dict__["launch"],
        ModelRunner.__dict__["launch_iter"],
        speculative.chunked_catch_up,
    )
    assert after == before
    saved = json.loads((tmp_path / "host-diag-cpu-t.json").read_text())
    assert saved["command"].startswith("python bench/host_diag.py") and saved["device"] == "cpu"
    calls = saved["slow_calls"]
    for key in ("LaneDispatcher._plan", "SpeculationPolicy.decide", "Scheduler.plan_decode"):
        assert calls[key]["calls"] == calls[key]["slow"] > 0
    lanes = {launch["lane"] for launch in saved["slow_launches"]}
    assert {"prefill", "decode"} <= lanes
    assert out["slow_calls"] == calls
    every = saved["every_call"]  # every call timed, by method and launch kind
    assert every["LaneDispatcher._plan"]["calls"] == calls["LaneDispatcher._plan"]["calls"]
    launches = ("ModelRunner.launch[prefill]", "ModelRunner.launch[decode]")
    for key in ("LaneDispatcher._plan", *launches):
        e = every[key]
        assert e["calls"] > 0 and 0 < e["p50_ms"] <= e["p99_ms"] <= e["max_ms"] <= e["total_ms"]


def test_host_diag_profiles_launches_and_chained_drafts(tmp_path) -> None:
    """--cprofile: the drafting launches, the plain ones and the chained drafting profiled
    apart, written beside the summary; the flag is not passed on to bench/mixed.py."""
    diag = load_bench("host_diag")
    args = [*SWEEP_TINY, "--modes", "policy", "--rates", "20", "--profiles", "hetero"]
    diag.main([*args, "--out", str(tmp_path), "--tag", "p", "--cprofile"])
    text = (tmp_path / "host-diag-cpu-p.pstats.txt").read_text()
    for key in ("launch+drafts", "launch,", "DraftChainer.chain"):
        assert f"==== {key}" in text
    assert "function calls" in text and "prepare" in text  # ModelRunner.prepare, inside launches


def test_host_diag_splits_a_slow_call_into_the_calls_inside_it(tmp_path, monkeypatch) -> None:
    """Every call counted as slow: a proposal's time splits into the wrapped calls directly
    inside it (the drafter's proposal, and its catch-up and view preparation inside that) and
    the rest of its own, which add up to the call; the summary sums them per method."""
    diag = load_bench("host_diag")
    monkeypatch.setattr(diag, "SLOW_S", 0.0)
    args = [*SWEEP_TINY, "--modes", "policy", "--rates", "20", "--profiles", "hetero"]
    saved = diag.main([*args, "--out", str(tmp_path), "--tag", "n"])
    kept = saved["slow_inside"]
    outer = kept["SpeculationPolicy.propose"]
    assert 0 < len(outer) <= diag.SLOW_INSIDE_KEPT
    assert [c["ms"] for c in outer] == sorted((c["ms"] for c in outer), reverse=True)
    drafted = [c for c in outer if "DraftModelProposer.propose" in c["inside_ms"]]
    assert drafted
    for c in drafted:
        assert sum(c["inside_ms"].values()) == pytest.approx(c["ms"], abs=0.05)
    inner = kept["DraftModelProposer.propose"]
    assert any("chunked_catch_up" in c["inside_ms"] for c in inner)
    assert any("DraftModelProposer._prepare_view" in c["inside_ms"] for c in inner)
    summed = diag.inside_summed(kept)["SpeculationPolicy.propose"]
    assert summed["calls"] == len(outer)
    assert summed["ms"] == pytest.approx(sum(c["ms"] for c in outer), abs=0.05)


def test_host_diag_times_each_piece_of_a_launch_in_pieces(monkeypatch) -> None:
    """A step launched in pieces (GPU: ``ModelRunner.launch_iter``, the event loop running
    between them): each piece is timed on its own, the slow ones kept in order with their
    index, and the wrapped generator still yields once per pause and returns the step."""
    import time
    from types import SimpleNamespace as NS

    diag = load_bench("host_diag")
    monkeypatch.setattr(diag, "SLOW_S", 0.004)

    def launch_iter(model_runner, plan, every=0):
        time.sleep(0.001)  # quick: not kept
        yield
        time.sleep(0.006)  # the slow piece
        yield
        return "pending"

    log = diag.HostLog()
    wrapped = log._launch_iter(launch_iter)
    plan = NS(lane="prefill", seqs=[1, 2], num_tokens=1998)
    gen = wrapped(None, plan, 4)
    assert [next(gen), next(gen)] == [None, None]
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "pending"
    assert len(log.took["ModelRunner.launch_iter[prefill]"]) == 3
    assert [(p["piece"], p["last"], p["tokens"]) for p in log.pieces] == [(1, False, 1998)]
    assert log.pieces[0]["ms"] >= 6.0
    assert log.summary()["slow_pieces"] == log.pieces
