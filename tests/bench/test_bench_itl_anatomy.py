"""ITL anatomy (bench/itl_anatomy.py, ``mixed.py --sweep --itl-anatomy``): each token matched
to the step that delivered it, by role and prompt-step company, on constructed steps and in a
tiny sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_bench
from sweep_helpers import tiny_policy_row


def _modules():
    return load_bench("ttft_anatomy"), load_bench("itl_anatomy"), load_bench("loadgen")


def _trace(loadgen, rid: str, deltas: list[tuple[float, int]]):
    t = loadgen.Trace(rid, "short", 8, 16, 0.0)
    t.deltas.extend(deltas)
    return t


def test_tokens_take_the_role_of_the_step_that_delivered_them() -> None:
    ttft, itl, loadgen = _modules()
    if not itl.SAME_CLOCK:
        assert itl.anatomy(ttft.StepLog(), []) is None
        return
    step = ttft.FoldedStep
    log = ttft.StepLog()
    log.steps = [
        step("decode", 0.000, 0.010, 2, rows={"a": "plain", "b": "plain"}),
        step("prefill", 0.012, 0.040, 512),
        step("decode", 0.010, 0.030, 2, rows={"a": "spec", "b": "rider"}),  # beside the prompt
        step("verify", 0.030, 0.045, 4, rows={"a": "catch_up"}),
        step("decode", 0.045, 0.050, 2, rows={"a": "plain", "b": "plain"}),
    ]
    log.launches = [(0.010, 0.0115, "decode", 2, 1, "speculate")]
    log.long_ticks = [(0.031, 0.004)]  # a 4 ms tick in b's last gap
    traces = [
        # a: 10 ms plain; a spec round beside the prompt step (20 ms, 2 tokens); the catch-up
        # verify (15 ms, 1 token); a plain step after the prompt (5 ms)
        _trace(loadgen, "a", [(0.0, 1), (0.010, 1), (0.030, 2), (0.045, 1), (0.050, 1)]),
        # b: its rider token waited 20 ms beside the prompt; then a 20 ms plain gap
        _trace(loadgen, "b", [(0.0, 1), (0.010, 1), (0.030, 1), (0.050, 1)]),
    ]
    rows = itl.samples(log, traces)
    roles = [(r[2], r[3]) for r in rows]
    assert roles == [
        ("plain", False), ("spec", True), ("catch_up", True), ("plain", False),
        ("plain", False), ("rider", True), ("plain", True),
    ]  # fmt: skip
    assert rows[5][4] == pytest.approx(0.020) and rows[5][5] == pytest.approx(0.0)
    # b's last gap (30 -> 50 ms) was delivered by a 5 ms step: it waited 15 ms for its launch
    assert rows[6][4] == pytest.approx(0.005) and rows[6][5] == pytest.approx(0.015)
    out = itl.anatomy(log, traces, tail_q=80.0)
    assert out["num_tokens"] == 8
    # per token: 10, 10, 10, 15, 5 (a); 10, 20, 20 (b): the 80th percentile is 18 ms (numpy's
    # linear one), and the tokens at or above it are b's two 20 ms ones
    assert out["itl_p99_ms"] == pytest.approx(18.0)
    assert out["num_tail_tokens"] == 2
    assert out["tail_rider_shared_share"] == pytest.approx(0.5)
    assert out["tail_plain_shared_share"] == pytest.approx(0.5)
    assert "tail_spec_shared_share" not in out  # a's round gave 10 ms a token: not in the tail
    assert out["spec_share"] == pytest.approx(2 / 8) and out["rider_share"] == pytest.approx(1 / 8)
    assert out["shared_share"] == pytest.approx(5 / 8)
    assert out["tail_gap_p50_ms"] == pytest.approx(20.0)
    assert out["tail_wait_p50_ms"] == pytest.approx(7.5)  # 0 (rider) and 15 (plain)
    # The slowest tokens with what happened in their gaps (ties: the earlier first)
    rider, plain = out["worst"][:2]
    assert (rider["role"], plain["role"]) == ("rider", "plain")
    assert rider["request_id"] == "b" and rider["gap_ms"] == pytest.approx(20.0)
    assert rider["prompt_ms"] == pytest.approx(18.0)  # the prompt step ran 12-30 of its 10-30
    assert rider["events"] == [
        "+0.0 launch decode 2/1 speculate (1.5 ms)",
        "+20.0 fold decode 2 (20.0 ms)",
    ]
    assert plain["tick_max_ms"] == pytest.approx(4.0) and rider["tick_max_ms"] == 0.0
    assert plain["events"][-1] == "+20.0 fold decode 2 (5.0 ms)"
    assert len(out["worst"]) == 7  # every sample, fewer than k
    assert out["tpot_tail"] == []  # neither request finished: no TPOT
    for t in traces:
        t.finish_time, t.finish_reason = t.deltas[-1][0], "length"
    tail = itl.anatomy(log, traces, tail_q=80.0)["tpot_tail"]
    # b (50 ms over 3 gaps) before a (50 ms over 5 tokens); each gap with the step that ended it
    assert [r["request_id"] for r in tail] == ["b", "a"]
    assert tail[0]["tpot_ms"] == pytest.approx(50 / 3, abs=1e-3)
    assert tail[0]["gaps"] == [
        [10.0, 10.0, 1, "plain", False, "decode", 2, 10.0],
        [30.0, 20.0, 1, "rider", True, "decode", 2, 20.0],
        [50.0, 20.0, 1, "plain", True, "decode", 2, 5.0],
    ]
    assert tail[1]["gaps"][2][:6] == [45.0, 15.0, 1, "catch_up", True, "verify"]


def test_a_delta_no_step_explains_is_unmatched() -> None:
    ttft, itl, loadgen = _modules()
    if not itl.SAME_CLOCK:
        return  # anatomy() is None there (the test above checks it)
    log = ttft.StepLog()
    log.steps = [ttft.FoldedStep("decode", 0.0, 0.010, 1, rows={"a": "plain"})]
    traces = [_trace(loadgen, "a", [(0.0, 1), (0.010, 1), (0.030, 1)])]  # 2nd: no step
    out = itl.anatomy(log, traces)
    assert out["plain_share"] == pytest.approx(0.5) and out["unmatched_share"] == pytest.approx(0.5)


def test_tiny_sweep_with_itl_anatomy(tmp_path: Path) -> None:
    row = tiny_policy_row(tmp_path, "--itl-anatomy")
    ana = row["itl_anatomy"]
    if ana is None:  # the client's clock is not the engine's here
        return
    assert ana["num_tokens"] > 0
    shares = sum(ana.get(f"{r}_share", 0.0) for r in ("plain", "rider", "spec", "catch_up"))
    assert shares == pytest.approx(1.0)  # every token was matched to a step that held it
    assert ana["itl_p99_ms"] == pytest.approx(row["itl_p99_ms"], rel=1e-6)
    assert ana.get("spec_share", 0.0) > 0  # the policy speculated for some tokens
