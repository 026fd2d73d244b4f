"""bench/host_inputs.py on CPU: every case is timed on the plan it names (the fold-back's again
and again on blocks not cached yet), and two results compare case by case into a table, a JSON
and a figure."""

from __future__ import annotations

import json

from helpers import load_bench


def test_host_inputs_times_every_case_and_compares_two_runs(tmp_path) -> None:
    bench = load_bench("host_inputs")
    for tag in ("a", "b"):
        bench.main(["--device", "cpu", "--no-ceilings", "--rounds", "2", "--calls", "1",
                    "--out", str(tmp_path), "--tag", tag])  # fmt: skip
    a = json.loads((tmp_path / "host_inputs-cpu-a.json").read_text())
    cases = a["results"]["cases"]
    assert a["complete"] and a["git_commit"]
    assert {n: (c["tokens"], c["rows"]) for n, c in cases.items()} == {
        **{f"prompt {t} in 6": (t, 6) for t in bench.PROMPT_STEPS},
        **{f"prompt {t} in 1": (t, 1) for t in bench.PROMPT_STEPS},
        **{f"decode {r} rows": (r, r) for r in bench.DECODE_ROWS},
        **{f"fold-back {t} in 6": (t, 6) for t in bench.PROMPT_STEPS[1:]},
    }
    assert cases["fold-back 8192 in 6"]["blocks"] == 8192 // a["results"]["block_size"]
    assert all(len(c["rounds_ms"]) == 2 and c["ms"] > 0 for c in cases.values())
    report = bench.main(["--compare", str(tmp_path / "host_inputs-cpu-a.json"),
                         str(tmp_path / "host_inputs-cpu-b.json"), "--out", str(tmp_path),
                         "--tag", "ab"])  # fmt: skip
    assert [r["case"] for r in report["table"]] == list(cases)
    assert all(r["a_ms"] == round(cases[r["case"]]["ms"], 4) for r in report["table"])
    assert json.loads((tmp_path / "host_inputs-compare-ab.json").read_text()) == report
    assert (tmp_path / "host_inputs-compare-ab.png").stat().st_size > 0
