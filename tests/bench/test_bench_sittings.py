"""bench/sittings.py: sweep reports' vLLM checks side by side, per rate and p99."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench


def _check(rate: float, ttft: tuple, itl: tuple, tpot: tuple, temp: float = 0.0) -> dict:
    cell = lambda v: {"policy": v[0], "vllm": v[1], "clear": v[2]}  # noqa: E731
    ok = all(v[0] <= v[1] for v in (ttft, itl, tpot))
    return {"acceptance_profile": "hetero", "temperature": temp, "rate": rate,
            "ttft_p99_ms": cell(ttft), "itl_p99_ms": cell(itl), "tpot_p99_ms": cell(tpot),
            "ok": ok}  # fmt: skip


def test_sittings_side_by_side(tmp_path) -> None:
    sittings = load_bench("sittings")
    a = {"git_commit": "a", "criteria": {"policy_ahead_of_vllm": {"checks": [
        _check(2.0, (40, 50, False), (8, 6, True), (5, 5, False)),
        _check(8.0, (90, 100, False), (15, 20, True), (6, 7, False)),
        _check(2.0, (99, 1, True), (99, 1, True), (99, 1, True), temp=0.7),  # not T = 0
    ]}}}  # fmt: skip
    ahead = _check(2.0, (1, 2, False), (1, 2, False), (1, 2, False))  # in-process: not read
    b = {"git_commit": "b", "criteria": {
        "policy_ahead_of_vllm": {"checks": [ahead]},
        "http_variants_ahead_of_vllm": {"policy-http-proc": {"checks": [
            _check(2.0, (60, 50, True), (6, 8, False), (4, 5, False)),
            _check(8.0, (80, 100, False), (15, 20, True), (8, 7, False)),
        ]}},
    }}  # fmt: skip
    for name, rep in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rep))
    out = sittings.main([str(tmp_path / "a.json"), str(tmp_path / "b.json") + ":policy-http-proc",
                         "--out", str(tmp_path / "s.json")])  # fmt: skip
    assert [s["rates_ahead"] for s in out["sittings"]] == [[8.0], []]  # b's TPOT at 8 trails
    cells = {(c["rate"], c["metric"]): c for c in out["cells"]}
    itl2 = cells[(2.0, "itl_p99_ms")]
    assert itl2["ratios"] == [pytest.approx(8 / 6, abs=1e-4), 0.75]
    assert (itl2["num_ahead"], itl2["num_clearly_ahead"], itl2["num_clearly_behind"]) == (1, 0, 1)
    ttft2 = cells[(2.0, "ttft_p99_ms")]
    assert ttft2["num_clearly_behind"] == 1 and ttft2["ratio_median"] == pytest.approx(1.0)
    assert cells[(8.0, "itl_p99_ms")]["num_clearly_ahead"] == 2
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["sittings"][1]["variant"] == "policy-http-proc"
    assert (tmp_path / "s.png").is_file()
    with pytest.raises(SystemExit):  # no such variant
        sittings.main([str(tmp_path / "a.json") + ":policy-http-x"])
