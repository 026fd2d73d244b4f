"""bench/tpot_pairs.py: two runs of one trace lined up token by token, the lag's growth
credited to the kind of our step that ended each gap and to the gap's size."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench


def _row(mode: str, deltas: list[list[float]], tpot: float, **extra) -> dict:
    entry = {"request_id": "req-7", "tpot_ms": tpot, "num_output": 5, "deltas_ms": deltas,
             "arrival_ms": 1000.0}  # fmt: skip
    other = {"request_id": "req-9", "tpot_ms": 1.0, "num_output": 2}  # no deltas: not paired
    return {"rate": 20.0, "acceptance_profile": "hetero", "temperature": 0.0, "mode": mode,
            "tpot_p99_ms": tpot, "slowest": {"tpot": [entry, other]}, **extra}  # fmt: skip


def test_lag_goes_to_the_step_that_ended_each_gap(tmp_path) -> None:
    pairs = load_bench("tpot_pairs")
    # Ours: first token at 20 ms, then 5 ms, a 30 ms gap beside a prompt step, then one delta
    # of two tokens (a speculative round) 6 ms later. The peer: 25 ms, then 5, 40, 5, 5.
    ours = [[20.0, 1], [25.0, 1], [55.0, 1], [61.0, 2]]
    peer = [[25.0, 1], [30.0, 1], [70.0, 1], [75.0, 1], [80.0, 1]]
    tail = {"request_id": "req-7", "tpot_ms": 10.25, "gaps": [
        [25.0, 5.0, 1, "plain", False, "decode", 40, 4.8],
        [55.0, 30.0, 1, "plain", True, "decode", 40, 12.0],
        [61.0, 6.0, 2, "spec", False, "verify", 80, 5.5],
    ]}  # fmt: skip
    steps = [{"t_ms": 1040.0, "step_ms": 15.0}, {"t_ms": 1070.0, "step_ms": 30.0},
             {"t_ms": 1071.0, "step_ms": 1.0}]  # fmt: skip
    a = _row("policy", ours, 10.25, itl_anatomy={"tpot_tail": [tail]})
    b = _row("vllm", peer, 13.75, engine_steps=steps)
    paths = []
    for name, row in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"sweep": [row], "device": "test", "git_commit": name}))
    out = pairs.main([str(paths[0]), str(paths[1]), "--rate", "20",
                      "--out", str(tmp_path / "p.json")])  # fmt: skip
    rate = out["rates"][0]
    assert rate["num_paired"] == 1  # req-9 has no deltas
    p = rate["pairs"][0]
    assert p["ttft_lag_ms"] == pytest.approx(-5.0)
    # lag per token: -5, -5, -15, -14, -19: the decode lag is -14 ms
    assert p["decode_lag_ms"] == pytest.approx(-14.0)
    assert p["lag_by_kind_ms"] == {"decode": 0.0, "decode+prompt": -10.0, "verify": -4.0}
    assert p["lag_by_size_ms"] == {"steady": -4.0, "stall": -10.0}  # 0 + (-4); the 30 ms gap
    assert p["gaps_by_size"]["peer"]["stall"] == {"gaps": 1, "ms": 40.0}
    # each engine's own time per gap size, summed over the paired requests
    assert rate["gaps_by_size"]["ours"] == {"steady": {"gaps": 2, "ms": 11.0},
                                            "stall": {"gaps": 1, "ms": 30.0}}  # fmt: skip
    assert rate["gaps_by_size"]["peer"]["steady"] == {"gaps": 3, "ms": 15.0}
    # the largest growth first: the plain step (0), then the round (-4); with the peer's steps
    first = p["largest"][0]
    assert first["at_ms"] == 25.0 and first["step"]["lane"] == "decode"
    biggest_loss = min(p["largest"], key=lambda g: g["lag_growth_ms"])
    assert biggest_loss["kind"] == "decode+prompt" and biggest_loss["tokens"] == 1
    assert [s["t_ms"] for s in biggest_loss["peer_steps"]] == [1040.0, 1070.0]
    assert json.loads((tmp_path / "p.json").read_text())["rates"][0]["num_paired"] == 1
    with pytest.raises(SystemExit):
        pairs.main([str(paths[0]), str(paths[1]), "--rate", "26"])
