"""The sweep's criteria (bench/sweep_criteria.py) on constructed rows: goodput at each TPOT
target of the ladder, the three criteria (a miss shows MISS), policy variants and the
--engine-process front judged on their own, and a repeat of the plan (the spread between two
runs, the misses it replicates)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_bench
from sweep_helpers import _row

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_goodput_at_each_tpot_target_of_the_ladder() -> None:
    sweep = load_bench("sweep")
    plan = SimpleNamespace(slo_ttft_ms=300.0, slo_tpot_ms=15.0)

    def trace(ttft_s: float, tpot_s: float):
        return SimpleNamespace(finish_reason="length", ttft_s=ttft_s, tpot_s=tpot_s)

    traces = [trace(0.1, 0.0035), trace(0.1, 0.0045), trace(0.1, 0.012), trace(0.5, 0.003)]
    assert sweep.goodput(traces, 2.0, plan) == (1.5, 3)  # the stated SLO: TTFT 300, TPOT 15
    assert sweep.goodput(traces, 2.0, plan, 4.0) == (0.5, 1)
    assert sweep.goodput(traces, 2.0, plan, 3.0) == (0.0, 0)  # the 3 ms one is past 300 ms
    crit = load_bench("sweep_criteria")
    ladder = lambda mode, rate, **g: {**_row(mode, rate), "goodput_by_tpot_slo": g}  # noqa: E731
    rows = [ladder("off", 2, **{"4": 1.0, "15": 2.0}), ladder("policy", 2, **{"4": 1.6, "15": 2.0}),
            ladder("three-fixed", 2, **{"4": 1.2, "15": 1.9}),
            ladder("off", 8, **{"4": 2.0, "15": 8.0}), ladder("policy", 8, **{"4": 2.1, "15": 7.0}),
            ladder("policy-x", 8, **{"4": 9.0, "15": 9.0})]  # fmt: skip
    got = {c["tpot_slo_ms"]: c for c in crit.goodput_gain_by_tpot_slo(rows)}
    assert set(got) == {4.0, 15.0}
    assert got[4.0]["rate"] == 2 and got[4.0]["best_mode"] == "three-fixed"  # not policy-x
    assert got[4.0]["gain"] == pytest.approx(1.6 / 1.2 - 1) and got[4.0]["ok"]
    assert got[15.0]["gain"] == pytest.approx(0.0) and not got[15.0]["ok"]  # its best rate, 2
    lines = crit.goodput_ladder_lines(list(got.values()))
    assert lines[0].startswith("  +15% T=0 TPOT <= 4 ms: +33% at 2 req/s")
    assert crit.goodput_gain_by_tpot_slo([_row("off", 2), _row("policy", 2)]) == []


def test_criteria_on_constructed_rows() -> None:
    sweep = load_bench("sweep_criteria")
    rows = [_row("off", 2, p50=12.0), _row("three-fixed", 2, itl=18.0),
            _row("policy", 2, itl=18.5, good=5.9, p50=7.0),
            _row("off", 8, good=4.0), _row("three-fixed", 8, good=4.2),
            _row("policy", 8, ttft=104.0, good=4.0)]  # fmt: skip
    crit = sweep.criteria(rows)
    within = crit["policy_within_5pct_of_best"]
    assert within["verdict"] == "PASS" and within["num_checks"] == 8
    gain = crit["hetero_goodput_gain_15pct"]  # 5.9 / 5.0 = +18 % at rate 2
    assert gain["verdict"] == "PASS" and gain["checks"][0]["rate"] == 2
    light = crit["light_load_tpot_p50_1p5x_off"]  # 12 / 7 = 1.71x
    assert light["verdict"] == "PASS" and light["checks"][0]["speedup"] == pytest.approx(12 / 7)
    rows[5]["itl_p99_ms"] = 21.1  # 5.5 % behind the best (20.0): a miss
    rows[2]["goodput_rps"] = 5.7  # +14 % only
    rows[0]["tpot_p50_ms"] = 10.0  # 1.43x only
    crit = sweep.criteria(rows)
    assert [c["verdict"] for c in crit.values()] == ["MISS"] * 3
    (miss,) = [c for c in crit["policy_within_5pct_of_best"]["checks"] if not c["ok"]]
    assert (miss["rate"], miss["metric"], miss["best_mode"]) == (8, "itl_p99_ms", "off")
    lines = sweep.criteria_lines(crit)
    assert sum(line.startswith("MISS") for line in lines) == 3
    assert any("metric=itl_p99_ms" in line and "MISS" in line for line in lines)
    assert sweep.criteria([_row("off", 2)])["hetero_goodput_gain_15pct"]["verdict"] == "N/A"
    assert "num_clear_misses" not in crit["policy_within_5pct_of_best"]  # rows without intervals
    # A policy variant is judged on its own against the non-policy modes, and does not count
    # as a rival of ``policy``.
    tight = [_row("policy-tight", 2, itl=10.0, good=5.0, p50=6.0)]
    assert sweep.policy_variants(rows + tight) == ["policy-tight"]
    assert sweep.criteria(rows + tight) == crit
    crit_tight = sweep.criteria(rows + tight, "policy-tight")
    assert crit_tight["light_load_tpot_p50_1p5x_off"]["checks"][0]["speedup"] == 10.0 / 6.0


def test_repeat_spread_of_two_runs_of_one_plan(tmp_path: Path) -> None:
    """Two runs of the same plan: the relative spread per metric over the cells both have,
    and the share of cells beyond the criteria's 5 %; a repeat of another plan is refused."""
    sweep, report = load_bench("sweep_criteria"), load_bench("sweep_report")
    a = [_row("off", 2, itl=10.0, ttft=100.0), _row("policy", 2, itl=10.0, ttft=100.0),
         _row("off", 8, itl=20.0, ttft=100.0)]  # fmt: skip
    b = [_row("off", 2, itl=10.4, ttft=100.0), _row("policy", 2, itl=13.0, ttft=100.0),
         _row("three-fixed", 8)]  # a cell only one run has: not compared  # fmt: skip
    spread = sweep.repeat_spread(a, b)
    itl = spread["itl_p99_ms"]
    assert itl["cells"] == 2 and itl["share_above_tol"] == 0.5
    assert itl["max"] == pytest.approx(0.3) and itl["median"] == pytest.approx(0.17)
    assert spread["ttft_p99_ms"]["share_above_tol"] == 0.0
    assert any("itl_p99_ms: 50% of 2 cells" in line for line in sweep.spread_lines(spread))
    plan = {"rates": [2, 8]}
    paths = []
    for name, rows, cfg in (("a", a, plan), ("b", b, plan), ("c", b, {"rates": [5]})):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"sweep": rows, "sweep_config": cfg, "command": name}))
    merged = report.main([str(paths[0]), "--repeat", str(paths[1]),
                          "--out", str(tmp_path / "m.json")])  # fmt: skip
    assert merged["repeat_spread"]["itl_p99_ms"]["cells"] == 2
    assert merged["repeat_misses"]["misses"] == 0  # the policy misses nothing in run a
    assert merged["sources"]["repeat"] == "b"
    with pytest.raises(SystemExit):
        report.main([str(paths[0]), "--repeat", str(paths[2]), "--out", str(tmp_path / "n.json")])


def test_misses_replicated_in_a_repeat() -> None:
    """A within-5 % miss counts as replicated only where the repeat misses the same check; a
    policy variant's rows are not among the modes the policy is judged against."""
    sweep = load_bench("sweep_criteria")
    a = [_row("off", 2, itl=10.0), _row("policy", 2, itl=12.0),  # ITL miss in both runs
         _row("off", 8, tpot=10.0), _row("policy", 8, tpot=11.0),  # TPOT miss in a only
         _row("policy-yield", 8, tpot=5.0)]  # fmt: skip
    b = [_row("off", 2, itl=10.0), _row("policy", 2, itl=11.0),
         _row("off", 8, tpot=10.0), _row("policy", 8, tpot=10.2)]  # fmt: skip
    rep = sweep.replicated_misses(a, b)
    assert (rep["misses"], rep["replicated"]) == (2, 1)
    by_metric = {m["metric"]: m for m in rep["checks"]}
    assert by_metric["itl_p99_ms"]["replicated"] and by_metric["itl_p99_ms"]["rate"] == 2
    assert by_metric["itl_p99_ms"]["repeat_ratio"] == pytest.approx(1.1)
    assert not by_metric["tpot_p99_ms"]["replicated"]
    lines = sweep.replicated_lines(rep)
    assert lines[0] == "misses replicated in the repeat: 1 of 2" and len(lines) == 2
    assert "itl_p99_ms: 1.20 and 1.10" in lines[1]


def test_engine_process_rows_are_judged_against_their_own_front() -> None:
    """``policy-proc`` (``--engine-process``) is judged against ``off-proc`` and the other
    ``-proc`` modes, the in-process ``policy`` against the in-process modes only; the merged
    report carries each variant's criteria and prints them."""
    sweep, report = load_bench("sweep_criteria"), load_bench("sweep_report")
    rows = [_row("off", 2, itl=5.0, p50=4.0), _row("policy", 2, itl=5.1, p50=2.0),
            _row("off-proc", 2, itl=9.0, p50=8.0), _row("policy-proc", 2, itl=9.2, p50=4.0),
            _row("policy-proc", 8), _row("off-proc", 8, ttft=90.0)]  # fmt: skip
    assert sweep.front_of("policy-proc") == "-proc" and sweep.front_of("off") == ""
    mine = sweep.criteria(rows)  # against off (5.0), not off-proc's 9.0
    assert mine["policy_within_5pct_of_best"]["verdict"] == "PASS"
    assert {c["best_mode"] for c in mine["policy_within_5pct_of_best"]["checks"]} == {"off"}
    assert mine["light_load_tpot_p50_1p5x_off"]["checks"][0]["speedup"] == 2.0
    proc = sweep.criteria(rows, "policy-proc")
    within = proc["policy_within_5pct_of_best"]
    assert {c["best_mode"] for c in within["checks"]} == {"off-proc"}
    (miss,) = [c for c in within["checks"] if not c["ok"]]  # TTFT 100 against 90 at 8 req/s
    assert (miss["rate"], miss["metric"]) == (8, "ttft_p99_ms")
    light = proc["light_load_tpot_p50_1p5x_off"]
    assert light["checks"][0]["off_tpot_p50_ms"] == 8.0 and light["verdict"] == "PASS"
    lone = sweep.criteria([_row("policy-proc", 2), _row("off", 2)], "policy-proc")
    assert lone["light_load_tpot_p50_1p5x_off"]["reason"].endswith("'off-proc'")
    merged = report.merge({"sweep": rows}, [], [])
    assert merged["criteria_variants"]["policy-proc"] == proc
    lines = report.report_lines(merged)
    at = lines.index("policy-proc:")
    assert lines[at + 1].startswith("  MISS policy_within_5pct_of_best: 7/8 checks ok")
    assert "criteria_variants" not in report.merge({"sweep": rows[:2]}, [], [])
