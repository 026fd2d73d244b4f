"""bench/catch_up_cost.py on CPU: the chunk replays of a catch-up stop one token short of the
context (as a catch-up round's do), every row counts its replays and tokens, and the report is
written with its metadata."""

from __future__ import annotations

import json

from helpers import load_bench


def test_catch_up_cost_counts_replays_and_tokens(tmp_path) -> None:
    bench = load_bench("catch_up_cost")
    args = ["--device", "cpu", "--model", "dummy:tiny", "--context", "64", "--sizes", "16,32",
            "--rows", "1,2", "--repeats", "1", "--out", str(tmp_path), "--tag", "t"]  # fmt: skip
    report = bench.main(args)
    saved = json.loads((tmp_path / "catch_up_cost-cpu-t.json").read_text())
    assert saved["results"] == report["results"] and saved["git_commit"]
    rows = {(r["kind"], r["q"], r["rows"]): r for r in saved["results"]}
    assert set(rows) == {(k, q, n) for n in (1, 2) for k, q in
                         (("eager", None), ("chunks", 16), ("chunks", 32))}  # fmt: skip
    # 63 tokens to feed (all but the last): 3 replays of 16, 1 of 32
    assert rows[("chunks", 16, 2)]["replays"] == 3 and rows[("chunks", 16, 2)]["tokens_fed"] == 96
    assert rows[("chunks", 32, 1)]["replays"] == 1 and rows[("chunks", 32, 1)]["tokens_fed"] == 32
    assert rows[("eager", None, 2)]["tokens_fed"] == 126
    for r in saved["results"]:
        assert r["host_ms"] > 0 and r["gpu_ms"] is None  # no GPU time on CPU
