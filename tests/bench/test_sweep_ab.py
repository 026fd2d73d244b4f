"""bench/sweep_ab.py and ``sweep_report.py --ab``: the same sweep plan run by two versions of
the code, cell by cell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_bench


def _row(mode, rate, itl=20.0, tpot=10.0, good=5.0, ci=None):
    return {"mode": mode, "rate": rate, "acceptance_profile": "hetero", "temperature": 0.0,
            "ttft_p99_ms": 100.0, "itl_p99_ms": itl, "tpot_p99_ms": tpot, "tpot_p50_ms": 5.0,
            "goodput_rps": good, "itl_p99_ci_ms": ci}  # fmt: skip


def test_each_shared_cell_is_compared_and_moves_are_counted() -> None:
    ab = load_bench("sweep_ab")
    new = [_row("off", 2, itl=18.0, ci=[17.0, 19.0]), _row("policy", 2, itl=21.5, good=5.5),
           _row("off", 8, itl=20.5, ci=[15.0, 30.0]), _row("policy", 8)]  # fmt: skip
    old = [_row("off", 2, itl=20.0, ci=[19.5, 21.0]), _row("policy", 2, itl=20.0),
           _row("off", 8, itl=20.0, ci=[16.0, 25.0]), _row("three-fixed", 8)]  # fmt: skip
    out = ab.ab_compare(new, old)
    itl = out["itl_p99_ms"]
    assert itl["cells"] == 3  # policy at 8 has no old row, three-fixed no new one
    assert (itl["better"], itl["worse"]) == (1, 1)  # -10 % and +7.5 %; +2.5 % is level
    assert itl["better_clear"] == 1 and "worse_clear" not in itl  # the worse one has no interval
    moved = {(c["mode"], c["rate"]): c["moved"] for c in itl["by_cell"]}
    assert moved == {("off", 2): "better", ("policy", 2): "worse", ("off", 8): "level"}
    assert itl["median_ratio"] == pytest.approx(20.5 / 20.0)
    good = out["goodput_rps"]  # higher is better
    assert (good["better"], good["worse"]) == (1, 0)
    assert out["tpot_p99_ms"]["better"] == out["tpot_p99_ms"]["worse"] == 0
    lines = ab.ab_lines(out, "new1", "old1")
    assert lines[0].startswith("new1 against old1")
    assert any("itl_p99_ms: median 1.025, better in 1 (1 clear), worse in 1 of 3" in x
               for x in lines)  # fmt: skip


def test_the_report_holds_the_ab_and_refuses_another_plan(tmp_path: Path) -> None:
    report = load_bench("sweep_report")
    plan = {"rates": [2, 8]}
    files = {}
    for name, commit, itl, cfg in (("new", "n1", 18.0, plan), ("old", "o1", 20.0, plan),
                                   ("other", "o2", 20.0, {"rates": [5]})):  # fmt: skip
        rows = [_row("off", 2, itl=itl), _row("policy", 2, itl=itl)]
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"sweep": rows, "sweep_config": cfg,
                                           "command": name, "git_commit": commit}))  # fmt: skip
    out = tmp_path / "ab.json"
    merged = report.main([str(files["new"]), "--ab", str(files["old"]), "--out", str(out)])
    assert (merged["ab"]["new"], merged["ab"]["old"]) == ("n1", "o1")
    assert merged["ab"]["itl_p99_ms"]["better"] == 2 and merged["sources"]["ab"] == "old"
    assert {r["mode"] for r in merged["sweep"]} == {"off", "policy"}  # judged: the new rows
    assert {r["mode"] for r in merged["ab_sweep"]} == {"off@o1", "policy@o1"}
    assert merged["criteria"]["policy_within_5pct_of_best"]["num_checks"] == 4
    written = json.loads(out.read_text())
    assert written["ab"]["itl_p99_ms"]["cells"] == 2 and len(written["ab_sweep"]) == 2
    assert (tmp_path / "ab-hetero-t0.0.png").exists()  # the old rows drawn beside the new
    with pytest.raises(SystemExit):
        report.main([str(files["new"]), "--ab", str(files["other"]), "--out", str(out)])
