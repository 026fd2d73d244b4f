"""bench/spec_off_pool.py: spec_off_cost runs pooled per server, a bootstrap interval on each
target's ratio, and a verdict that says when the runs cannot tell."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench

pool = load_bench("spec_off_pool")


def _result(none: list[tuple], drafter: list[tuple]) -> dict:
    """A spec_off_cost result whose runs have (tok/s, TTFT p99, ITL p99) as given."""
    runs = []
    for server, values in (("no-drafter", none), ("drafter", drafter)):
        for tok, ttft, itl in values:
            runs.append({"server": server, "output_tok_s": tok, "ttft_p99_ms": ttft,
                         "itl_p99_ms": itl, "itl_p50_ms": None})  # fmt: skip
    return {"device": "test", "git_commit": "abc", "runs": runs}


def test_verdicts_from_the_interval() -> None:
    assert pool.verdict(1.0, [0.98, 1.02], 0.05, higher_better=False) == "met"
    assert pool.verdict(1.2, [1.1, 1.3], 0.05, higher_better=False) == "missed"
    assert pool.verdict(1.07, [0.9, 1.3], 0.05, False) == "not settled (point missed)"
    assert pool.verdict(0.99, [0.96, 1.01], 0.03, True) == "not settled (point met)"
    assert pool.verdict(0.99, None, 0.03, True) == "met (one run a side)"


def test_ratio_interval_holds_the_ratio_and_narrows_with_agreeing_runs() -> None:
    wide = pool.ratio_interval([100, 130, 90, 120], [105, 140, 95, 80])
    assert wide[0] < (105 + 140 + 95 + 80) / (100 + 130 + 90 + 120) < wide[1]
    tight = pool.ratio_interval([100, 101, 100, 101], [110, 111, 110, 111])
    assert tight[1] - tight[0] < 0.03 < wide[1] - wide[0]
    assert pool.ratio_interval([100], [110, 111]) is None


def test_pooled_over_sittings(tmp_path) -> None:
    # Sitting one: the drafter 10 % slower on TTFT p99; sitting two: level. Throughput level.
    a = _result([(3000, 100, 20), (3010, 102, 21)], [(3005, 110, 20), (2995, 112, 21)])
    b = _result([(3100, 100, 20), (3090, 100, 20)], [(3095, 99, 20), (3105, 101, 20)])
    files = []
    for name, res in (("a", a), ("b", b)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(res))
        files.append(str(path))
    out = pool.main([*files, "--out", str(tmp_path / "pool.json")])
    ttft = out["pooled"]["ttft_p99_ms"]
    assert len(ttft["drafter_runs"]) == 4 and ttft["target"] == "ttft_p99"
    assert ttft["ratio"] == pytest.approx((110 + 112 + 99 + 101) / (100 + 102 + 100 + 100))
    assert ttft["sitting_ratios"] == [pytest.approx(222 / 202), pytest.approx(1.0)]
    assert out["pooled"]["output_tok_s"]["verdict"] == "met"
    assert ttft["verdict"].startswith("not settled")
    assert "itl_p50_ms" not in out["pooled"]  # no values: left out
    assert json.loads((tmp_path / "pool.json").read_text())["git_commits"] == ["abc", "abc"]
    assert (tmp_path / "pool.png").is_file()
