"""The sweep's report (bench/sweep_report.py, bench/sweep_plots.py) on constructed rows: the
merge of our runs with vLLM's and the HTTP rows (criteria against vLLM in process and over
HTTP, policy variants, which leads are clear of the intervals), the columnar policy timeline,
the compiles and fused rows it names, and the rate plots' goodput at a TPOT target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_bench
from sweep_helpers import _row

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_merge_with_vllm_and_http(tmp_path: Path) -> None:
    report = load_bench("sweep_report")
    ours = {
        "device": "GPU",
        "git_commit": "abc",
        "command": "python bench/mixed.py --sweep",
        "sweep": [
            {**_row("off", 2), "slowest": {"ttft": [{"request_id": "r1"}]}},
            _row("policy", 2, ttft=90.0, itl=15.0, tpot=8.0),
            _row("off", 8),
            _row("policy", 8, ttft=120.0, itl=15.0, tpot=8.0),
        ],
    }
    vllm = {
        "command": "python bench/peer_vllm.py sweep",
        "sweep": [{**_row("vllm", 2), "engine_steps": [{"t_ms": 1.0}]}, _row("vllm", 8)],
    }
    http = {"command": "python bench/mixed.py --sweep --http",
            "sweep": [_row("policy", 2, ttft=80.0, itl=19.0, tpot=9.0)]}  # fmt: skip
    off = {**ours, "sweep": [r for r in ours["sweep"] if r["mode"] == "off"]}  # one mode per run
    pol = {
        **ours,
        "sweep": [r for r in ours["sweep"] if r["mode"] == "policy"],
        "policy_timeline": [{"mode": "policy", "rate": 2, "acceptance_profile": "hetero",
                             "temperature": 0.0,
                             "samples": [{"t_s": 0.0, "mean_draft_len": 2.0}]}],
    }  # fmt: skip
    paths = []
    for name, data in (("off", off), ("pol", pol), ("vllm", vllm), ("http", http)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "merged.json"
    merged = report.main([str(paths[0]), str(paths[1]), "--vllm", str(paths[2]), "--http",
                          str(paths[3]), "--out", str(out)])  # fmt: skip
    assert len(merged["sweep"]) == 4 + 2 + 1
    written = json.loads(out.read_text())
    assert written["device"] == "GPU" and merged["git_commit"] == "abc"
    # the timeline stays in the run's own JSON; the report names that file
    assert "policy_timeline" not in written
    assert written["policy_timeline_in"] == ["off.json", "pol.json"]
    assert merged["policy_timeline"][0]["rate"] == 2
    assert {r["mode"] for r in merged["sweep"]} == {"off", "policy", "vllm", "http:policy"}
    ahead = merged["criteria"]["policy_ahead_of_vllm"]
    assert ahead["verdict"] == "MISS" and ahead["num_misses"] == 1  # TTFT 120 > 100 at 8/s
    assert [c["ok"] for c in ahead["checks"]] == [True, False]
    assert merged["criteria"]["http_policy_ahead_of_vllm"]["verdict"] == "PASS"
    assert merged["criteria"]["http_policy_ahead_of_vllm"]["vllm_front"] == "in-process"
    lines = report.report_lines(merged)
    assert any(line.startswith("MISS policy ahead of vLLM (in-process)") for line in lines)
    assert any("MISS hetero t=0.0 rate=8: ttft 120.0 vs 100.0" in line for line in lines)
    assert (tmp_path / "merged-hetero-t0.0.png").is_file()
    # the rows' diagnostics stay in the runs' files (vLLM's engine steps, the slowest requests)
    assert not any("engine_steps" in r or "slowest" in r for r in written["sweep"])
    assert [r["ttft_p99_ms"] for r in written["sweep"]] == [
        r["ttft_p99_ms"] for r in merged["sweep"]
    ]
    # one run alone: the report adds no rows, so no plots (the run has the same ones)
    report.main([str(paths[1]), "--out", str(tmp_path / "alone.json")])
    assert (tmp_path / "alone.json").is_file() and not list(tmp_path.glob("alone*.png"))
    # one run with HTTP rows: the rate plots gain rows, the policy's timeline is the run's own
    report.main([str(paths[1]), "--http", str(paths[3]), "--out", str(tmp_path / "one.json")])
    assert (tmp_path / "one-hetero-t0.0.png").is_file()
    assert not (tmp_path / "one-policy.png").exists()
    # an HTTP sitting alone: no in-process rows, the HTTP policy judged against vLLM's server
    vllm_http = {"command": "python bench/mixed.py --sweep --http", "git_commit": "def",
                 "sweep": [_row("vllm-http", 2, ttft=85.0, itl=20.0, tpot=9.5)]}  # fmt: skip
    (tmp_path / "vllm-http.json").write_text(json.dumps(vllm_http))
    sitting = report.main(["--http", str(paths[3]), str(tmp_path / "vllm-http.json"),
                           "--out", str(tmp_path / "sitting.json")])  # fmt: skip
    assert {r["mode"] for r in sitting["sweep"]} == {"http:policy", "http:vllm-http"}
    judged = sitting["criteria"]["http_policy_ahead_of_vllm"]
    assert judged["verdict"] == "PASS" and judged["vllm_front"] == "http"
    assert sitting["git_commit"] is None  # the first HTTP run's (none given here)
    with pytest.raises(SystemExit):
        report.main([])
    # a server run under another --mode-label, read as a policy variant by --label
    http["sweep"][0]["mode"] = "ours-ep"
    paths[3].write_text(json.dumps(http))
    args = [str(paths[1]), "--vllm", str(paths[2]), "--http", str(paths[3])]
    unread = report.main([*args, "--out", str(tmp_path / "unread.json")])
    assert "http_variants_ahead_of_vllm" not in unread["criteria"]
    read = report.main([*args, "--label", "ours-ep=policy-http-proc", "--out",
                        str(tmp_path / "read.json")])  # fmt: skip
    assert read["criteria"]["http_variants_ahead_of_vllm"]["policy-http-proc"]["verdict"] == "PASS"
    assert {r.get("mode_label") for r in read["sweep"] if r["mode"].startswith("http:")} == {
        "ours-ep"
    }
    with pytest.raises(SystemExit):
        report.main([*args, "--label", "ours-ep"])
    assert (tmp_path / "merged-policy.png").is_file()  # two runs' timelines joined
    none = report.ahead_of_vllm(ours["sweep"], [])
    assert none["verdict"] == "N/A"
    with pytest.raises(ValueError, match="different sweep plans"):
        report.join_ours([{**off, "sweep_config": {"rates": [1]}}, pol])


def test_the_vllm_comparison_says_which_leads_are_clear_of_the_intervals() -> None:
    report = load_bench("sweep_report")
    ci = lambda ttft, itl, tpot: {"ttft_p99_ci_ms": ttft, "itl_p99_ci_ms": itl,  # noqa: E731
                                  "tpot_p99_ci_ms": tpot}  # fmt: skip
    ours = [{**_row("policy", 2, ttft=120.0, itl=11.0, tpot=9.5),
             **ci([90.0, 130.0], [10.0, 12.0], [9.0, 10.0])},
            _row("policy", 8)]  # fmt: skip
    theirs = [{**_row("vllm", 2, ttft=100.0, itl=15.0, tpot=7.5),
               **ci([95.0, 105.0], [14.0, 16.0], [7.0, 8.0])},
              _row("vllm", 8, ttft=110.0, itl=25.0, tpot=12.0)]  # fmt: skip
    block = report.ahead_of_vllm(ours, theirs)
    first, second = block["checks"]
    # behind on TTFT within the intervals; ahead on ITL and behind on TPOT, both clear
    assert [first[m]["clear"] for m in ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms")] == [
        False, True, True]  # fmt: skip
    assert "clear" not in second["ttft_p99_ms"] and second["ok"]  # rows without intervals
    assert (block["num_weighed"], block["num_clearly_ahead"], block["num_clearly_behind"]) == (
        3, 1, 1)  # fmt: skip
    lines = report.vllm_lines(block, "vLLM")
    assert "1 clearly ahead, 1 clearly behind" in lines[0]
    assert "ttft 120.0 vs 100.0, itl 11.0 vs 15.0*, tpot 9.5 vs 7.5*" in lines[1]
    plain = report.ahead_of_vllm([_row("policy", 8)], theirs)
    assert "num_weighed" not in plain and "clearly" not in report.vllm_lines(plain, "vLLM")[0]


def test_http_policy_against_vllm_server_rows() -> None:
    """With vLLM's server driven by the same client, the HTTP policy rows are judged against
    those rows (labels ``policy-http`` / ``vllm-http``), not against in-process vLLM."""
    report = load_bench("sweep_report")
    ours = {"sweep": [_row("policy", 2)]}
    vllm = [{"sweep": [_row("vllm", 2, ttft=500.0, itl=50.0, tpot=50.0)]}]  # beaten in-process
    http = [{"sweep": [_row("policy-http", 2, ttft=80.0, itl=19.0, tpot=9.0),
                       _row("vllm-http", 2, ttft=70.0, itl=25.0, tpot=10.0)]}]  # fmt: skip
    merged = report.merge(ours, vllm, http)
    crit = merged["criteria"]["http_policy_ahead_of_vllm"]
    assert crit["vllm_front"] == "http" and crit["verdict"] == "MISS"
    assert crit["checks"][0]["ttft_p99_ms"] == {"policy": 80.0, "vllm": 70.0}
    assert any("HTTP policy rows vs http" in line for line in report.report_lines(merged))
    # A variant of our server (e.g. --engine-process) is judged on its own, beside it.
    http[0]["sweep"].append(_row("policy-http-proc", 2, ttft=60.0, itl=19.0, tpot=9.0))
    merged = report.merge(ours, vllm, http)
    variant = merged["criteria"]["http_variants_ahead_of_vllm"]["policy-http-proc"]
    assert variant["verdict"] == "PASS" and variant["checks"][0]["ttft_p99_ms"]["policy"] == 60.0
    assert merged["criteria"]["http_policy_ahead_of_vllm"]["verdict"] == "MISS"
    lines = report.report_lines(merged)
    assert any("HTTP policy-http-proc rows vs http" in line for line in lines)


def test_in_process_policy_variants_against_vllm() -> None:
    """Each in-process ``policy-NAME`` mode (e.g. the backlog lift, ``policy-burst``) is judged
    against vLLM on its own, beside the policy; without vLLM rows, none is."""
    report = load_bench("sweep_report")
    ours = {"sweep": [_row("off", 14), _row("policy", 14, ttft=121.0, itl=22.0, tpot=8.0),
                      _row("policy-burst", 14, ttft=94.0, itl=25.0, tpot=8.0)]}  # fmt: skip
    vllm = [{"sweep": [_row("vllm", 14, ttft=100.0, itl=32.0, tpot=9.0)]}]
    merged = report.merge(ours, vllm, [])
    assert merged["criteria"]["policy_ahead_of_vllm"]["verdict"] == "MISS"  # TTFT 121 > 100
    variant = merged["criteria"]["variants_ahead_of_vllm"]["policy-burst"]
    assert variant["verdict"] == "PASS" and variant["checks"][0]["ttft_p99_ms"]["policy"] == 94.0
    assert list(merged["criteria"]["variants_ahead_of_vllm"]) == ["policy-burst"]
    lines = report.report_lines(merged)
    assert any(line.startswith("PASS policy ahead of vLLM (in-process, policy-burst rows)")
               for line in lines)  # fmt: skip
    assert "variants_ahead_of_vllm" not in report.merge(ours, [], [])["criteria"]


def test_a_columnar_timeline_reads_back_as_its_snapshots():
    report = load_bench("sweep_report")
    samples = [
        {"t_s": 0.0, "num_steps": 3},
        {"t_s": 0.25, "num_steps": 5, "last_reason": "no_gain"},
    ]
    stored = report.columnar(samples)
    assert stored == {"columns": ["t_s", "num_steps", "last_reason"],
                      "values": [[0.0, 3, None], [0.25, 5, "no_gain"]]}  # fmt: skip
    assert report.timeline_samples({"rate": 2.0, **stored}) == samples
    assert report.timeline_samples({"rate": 2.0, "samples": samples}) == samples  # the old form


def test_the_report_names_compiles_and_fused_rows():
    report = load_bench("sweep_report")
    cell = {"mode": "policy", "acceptance_profile": "hetero", "temperature": 0.0, "rate": 14.0}
    rows = [
        {**cell, "num_kernel_compiles": 2, "num_decode_rows_fused": 0},
        {**cell, "mode": "http:policy-http",
         "server": {"server_kernel_compiles": 0.0, "server_decode_rows_fused": 96.0}},
        {**cell, "mode": "off", "num_kernel_compiles": 0},
        {**cell, "mode": "http:vllm-http", "server": {}},
    ]  # fmt: skip
    assert report.event_lines(rows) == [
        "STALL policy hetero T=0.0 14.0/s: 2 Triton compiles under traffic",
        "fused http:policy-http hetero T=0.0 14.0/s: 96 decode rows inside prompt steps",
    ]


def test_rate_plots_read_goodput_at_a_tpot_target(tmp_path: Path) -> None:
    """``goodput@Y`` panels read ``goodput_by_tpot_slo``; a row without the ladder has no
    point there; one PNG per (profile, temperature) with or without them."""
    plots = load_bench("sweep_plots")
    row = {"rate": 2.0, "acceptance_profile": "hetero", "temperature": 0.0, "mode": "policy",
           "itl_p99_ms": 5.0, "ttft_p99_ms": 40.0, "goodput_rps": 2.0,
           "goodput_by_tpot_slo": {"4": 1.5, "5": 2.0}}  # fmt: skip
    assert plots.panel_value(row, "goodput@4") == 1.5
    assert plots.panel_value(row, "goodput@3") is None
    assert plots.panel_value(row, "itl_p99_ms") == 5.0
    bare = {k: v for k, v in row.items() if k != "goodput_by_tpot_slo"}
    assert plots.panel_value(bare, "goodput@4") is None
    rows = [row, dict(bare, mode="off", rate=8.0), dict(row, rate=8.0)]
    paths = plots.plot_rates(tmp_path / "sweep", rows, tpot_slos=("4", "5"))
    assert [p.name for p in paths] == ["sweep-hetero-t0.0.png"] and paths[0].stat().st_size > 0
