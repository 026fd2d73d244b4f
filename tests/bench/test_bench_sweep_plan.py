"""The sweep's plan and per-request figures (bench/sweep.py): the plan's traces and acceptance
profiles (the same after a round trip through JSON), the burn-in (another trace at the first
rate), the slowest requests that keep the p99 company, and TPOT by acceptance class."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench
from sweep_helpers import _row

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _plan(sweep, **kw):
    mix = sweep.Mix((8, 16), (4, 8), (40, 64), (2, 4), 0.25)
    base = dict(mix=mix, vocab=512, seed=3, rates=(5.0, 10.0), profiles=("hetero", "uniform-0.6"),
                temperatures=(0.0,), num_requests=3000, run_seconds=0.0, drain_timeout=1.0,
                slo_ttft_ms=100.0, slo_tpot_ms=10.0)  # fmt: skip
    return sweep.SweepPlan(**{**base, **kw})


def test_plan_traces_and_profiles() -> None:
    sweep = load_bench("sweep")
    plan = _plan(sweep)
    again = sweep.SweepPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()  # (Mix: load_bench imports its own loadgen)
    a, b = plan.requests(5.0), again.requests(5.0)
    assert [(r.arrival_s, r.prompt) for r in a] == [(r.arrival_s, r.prompt) for r in b]
    assert [r.prompt for r in plan.requests(10.0)] != [r.prompt for r in a]
    hetero = plan.alphas(5.0, "hetero", 3000)
    assert hetero == again.alphas(5.0, "hetero", 3000)
    shares = {x: hetero.count(x) / 3000 for x in (0.9, 0.6, 0.2)}
    assert abs(shares[0.9] - 0.3) < 0.04 and abs(shares[0.6] - 0.4) < 0.04
    assert abs(shares[0.2] - 0.3) < 0.04 and sum(shares.values()) == 1
    assert plan.alphas(5.0, "uniform-0.6", 5) == [0.6] * 5
    bounded = _plan(sweep, run_seconds=2.0).requests(5.0)
    assert 0 < len(bounded) < 30 and all(r.arrival_s <= 2.0 for r in bounded)
    with pytest.raises(ValueError, match="profiles"):
        _plan(sweep, profiles=("uniform-0.5",))


def test_the_burn_in_is_another_trace_at_the_first_rate() -> None:
    sweep = load_bench("sweep")
    assert _plan(sweep).burn_in() is None
    plan = _plan(sweep, burn_in_s=2.0)
    burn = plan.burn_in()
    assert burn.rates == (5.0,) and burn.run_seconds == 2.0 and burn.burn_in_s == 0.0
    reqs, first = burn.requests(5.0), plan.requests(5.0)
    assert 0 < len(reqs) < 30 and all(r.arrival_s <= 2.0 for r in reqs)
    assert all(r.request_id.startswith("burn-") for r in reqs)
    assert [r.prompt for r in reqs] != [r.prompt for r in first[: len(reqs)]]  # another seed
    assert plan.requests(5.0)[0].request_id == "req-0"  # the measured trace is unchanged
    assert [(r.arrival_s, r.prompt) for r in first] == [
        (r.arrival_s, r.prompt) for r in _plan(sweep).requests(5.0)
    ]
    assert plan.estimate_s(2) == pytest.approx(_plan(sweep).estimate_s(2) + 2.0 + 4.0)  # once
    assert plan.estimate_s(2, with_burn_in=False) == pytest.approx(_plan(sweep).estimate_s(2))
    again = sweep.SweepPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.burn_in() == burn
    old = {k: v for k, v in plan.to_dict().items() if k not in ("burn_in_s", "id_prefix")}
    assert sweep.SweepPlan.from_dict(old).burn_in() is None  # results written before it


def test_slowest_requests_are_the_p99s_company() -> None:
    """The slowest requests by TTFT and by TPOT (5 %, at least 3), slowest first, each with
    its profile alpha; requests without a TPOT (one token, unfinished) are left out there."""
    sweep, loadgen = load_bench("sweep"), load_bench("loadgen")
    traces = []
    for i in range(40):  # TTFT grows with i, TPOT falls with it
        t = loadgen.Trace(f"req-{i}", "short", 10 + i, 8, arrival=0.0)
        t.deltas = [(0.01 * (i + 1), 1), (0.01 * (i + 1) + 0.001 * (50 - i), 3)]
        t.finish_time, t.finish_reason = t.deltas[-1][0], "length"
        traces.append(t)
    traces[0].finish_time = None  # unfinished: no TPOT
    alpha_of = {f"req-{i}": 0.2 if i % 2 else 0.9 for i in range(40)}
    slow = sweep.slowest_requests(traces, alpha_of, t_start=-0.5)
    assert [x["request_id"] for x in slow["ttft"]] == ["req-39", "req-38", "req-37"]
    assert [x["request_id"] for x in slow["tpot"]] == ["req-1", "req-2", "req-3"]
    first = slow["tpot"][0]
    assert first["alpha"] == 0.2 and first["prompt_len"] == 11 and first["num_output"] == 4
    assert first["tpot_ms"] == pytest.approx(49 / 3, abs=1e-3)  # kept to the microsecond
    assert first["max_gap_ms"] == pytest.approx(49)
    # every delta of the TPOT ones, ms from the arrival, and the arrival from the run's start
    assert first["deltas_ms"] == [[20.0, 1], [69.0, 3]]
    assert first["arrival_ms"] == pytest.approx(500.0)
    assert "deltas_ms" not in slow["ttft"][0]
    many = sweep.slowest_requests(traces * 3, alpha_of)  # 120 requests: 5 % is 6
    assert len(many["ttft"]) == 6


def test_tpot_by_alpha_class() -> None:
    """Per acceptance class, the finished requests with a TPOT and their TPOT p50 / p99: an
    unfinished request, a one-token one and a request without a class are left out; classes
    come highest α first."""
    sweep, loadgen = load_bench("sweep"), load_bench("loadgen")
    traces = []
    for i in range(9):  # TPOT i + 1 ms; classes 0.9 (i < 3), 0.6 (3 <= i < 6), 0.2
        t = loadgen.Trace(f"req-{i}", "short", 10, 4, arrival=0.0)
        t.deltas = [(0.01, 1), (0.01 + 0.003 * (i + 1), 3)]
        t.finish_time, t.finish_reason = t.deltas[-1][0], "length"
        traces.append(t)
    traces[8].finish_reason = "error"  # not finished: left out
    one = loadgen.Trace("req-one", "short", 10, 1, arrival=0.0)
    one.deltas, one.finish_time, one.finish_reason = [(0.01, 1)], 0.01, "length"
    alpha_of = {f"req-{i}": (0.9, 0.6, 0.2)[i // 3] for i in range(9)} | {"req-one": 0.2}
    by = sweep.tpot_by_alpha([*traces, one, loadgen.Trace("req-x", "short", 1, 4, 0.0)], alpha_of)
    assert list(by) == ["0.9", "0.6", "0.2"]
    assert by["0.9"]["num"] == 3 and by["0.9"]["tpot_p50_ms"] == pytest.approx(2.0)
    assert by["0.6"]["tpot_p50_ms"] == pytest.approx(5.0)
    assert by["0.2"]["num"] == 2 and by["0.2"]["tpot_p50_ms"] == pytest.approx(7.5)
    assert by["0.2"]["tpot_p99_ms"] == pytest.approx(7.99)
    # The light-load check gives off's TPOT p50 over the policy's per class both rows have.
    crit = load_bench("sweep_criteria")
    off, pol = _row("off", 2, p50=4.0), _row("policy", 2, p50=3.2)
    off["tpot_by_alpha"] = {"0.9": {"tpot_p50_ms": 4.0}, "0.6": {"tpot_p50_ms": 4.2}}
    pol["tpot_by_alpha"] = {"0.9": {"tpot_p50_ms": 2.0}, "0.6": {"tpot_p50_ms": 3.0},
                            "0.2": {"tpot_p50_ms": 4.4}}  # fmt: skip
    (check,) = crit.criteria([off, pol])["light_load_tpot_p50_1p5x_off"]["checks"]
    assert check["speedup_by_alpha"] == {"0.9": 2.0, "0.6": 1.4}
    assert "speedup_by_alpha" not in crit.light_load_tpot([_row("off", 2), _row("policy", 2)])[
        "checks"][0]  # fmt: skip
