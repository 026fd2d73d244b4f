"""bench/sample_cost.py on CPU (where both paths are the torch ops): every row and variant is
timed, the draws agree, and the report is written with its metadata and its plot (drawn again
by ``--replot``)."""

from __future__ import annotations

import json

from helpers import load_bench


def test_sample_cost_times_every_variant(tmp_path) -> None:
    bench = load_bench("sample_cost")
    args = ["--device", "cpu", "--rows", "1,3", "--vocab", "300", "--repeats", "2",
            "--out", str(tmp_path), "--tag", "t"]  # fmt: skip
    report = bench.main(args)
    saved = json.loads((tmp_path / "sample_cost-cpu-t.json").read_text())
    assert saved["results"] == report["results"] and saved["git_commit"]
    keys = {(r["rows"], r["variant"]) for r in saved["results"]}
    variants = {"race, torch ops", "race, kernel", "draft sampling, torch ops",
                "draft sampling, kernel"}  # fmt: skip
    assert keys == {(n, v) for n in (1, 3) for v in variants}
    for r in saved["results"]:
        assert r["draws_equal"] and r["host_ms"] > 0 and r["gpu_ms"] is None
    png = tmp_path / "sample_cost-cpu-t.png"
    assert png.stat().st_size > 0
    png.unlink()
    bench.main(["--replot", str(tmp_path / "sample_cost-cpu-t.json")])
    assert png.stat().st_size > 0
