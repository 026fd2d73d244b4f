"""bench/spec_off_cost.py: both servers (no drafter, drafter) start in turn on CPU with
dummy:tiny, serve every request of the same workload, and the report has the issue's numbers,
ratios and verdicts; the verdict math and the /metrics deltas on hand-made inputs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_bench

bench = load_bench("spec_off_cost")

TINY = ["--device", "cpu", "--model", "dummy:tiny", "--draft-model", "dummy:tiny",
        "--requests", "4", "--concurrency", "2", "--prompt-lens", "8", "16",
        "--output-len", "4", "--warmup-requests", "1", "--server-timeout", "180"]  # fmt: skip


def test_end_to_end_on_cpu(tmp_path: Path) -> None:
    report = bench.main([*TINY, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "spec_off_cost-cpu.json").read_text())
    assert saved["complete"] and saved["device"] == "cpu" and saved["git_commit"]
    assert saved["params"]["requests"] == 4 and saved["params"]["order"] == "AB"
    assert (tmp_path / "spec_off_cost-cpu.png").is_file()
    assert [r["server"] for r in report["runs"]] == ["no-drafter", "drafter"]
    for run in report["runs"]:
        assert run["num_finished"] == run["num_requests"] == 4 and run["num_errors"] == 0
        assert run["output_tokens"] == run["requested_output_tokens"] == 16
        assert run["output_tok_s"] > 0 and run["ttft_p99_ms"] > 0 and run["itl_p99_ms"] > 0
        assert any("sizing the KV" in line for line in run["server_log"])
        assert len(run["per_request"]) == 4 and all(r[2] > 0 for r in run["per_request"])
        waves = run["ttft_by_wave"]
        assert waves["first_wave"]["n"] == 2 and waves["later"]["n"] == 2
    off, on = report["runs"]
    assert off["spec"]["drafted_tokens"] == 0 and on["spec"]["draft_len_decisions"] > 0
    assert on["spec"]["policy_decide_s"] > 0 and off["spec"]["policy_decide_s"] == 0
    assert off["spec"]["policy_decisions"] == {} and sum(on["spec"]["policy_decisions"].values())
    assert any("drafter" in line for line in on["server_log"] if "sizing the KV" in line)
    assert "--draft-model" in on["command"] and "--draft-model" not in off["command"]
    # scraped once the opening wave had its first tokens: a part of the run's decisions
    wave = on["spec_opening_wave"]
    assert wave["draft_len_decisions"] <= on["spec"]["draft_len_decisions"]
    assert wave["policy_decide_s"] <= on["spec"]["policy_decide_s"]
    assert off["spec_opening_wave"]["policy_decisions"] == {}
    servers = report["servers"]
    assert servers["drafter"]["num_finished"] == servers["no-drafter"]["num_finished"] == 4
    assert servers["no-drafter"]["drafted_tokens"] == 0
    assert servers["drafter"]["opening_wave_draft_len_decisions"] == wave["draft_len_decisions"]
    ratio = servers["drafter"]["output_tok_s"] / servers["no-drafter"]["output_tok_s"]
    assert report["ratios"]["output_tok_s"] == pytest.approx(ratio)
    assert set(report["verdicts"]) == {"throughput", "ttft_p99", "itl_p99"}
    assert set(report["verdicts"].values()) <= {"PASS", "MISS"}
    assert report["acceptance"] == "real"  # tiny drafts for itself: not the dummy-pair label


def _run(server: str, index: int, tok_s: float, ttft: float, itl: float) -> dict:
    return {"server": server, "index": index, "output_tok_s": tok_s, "ttft_p50_ms": ttft / 2,
            "ttft_p99_ms": ttft, "itl_p50_ms": itl / 2, "itl_p99_ms": itl,
            "chunk_gap_p99_ms": itl}  # fmt: skip


def test_verdicts_against_the_issue_targets() -> None:
    runs = [_run("no-drafter", 0, 2500, 240, 24), _run("drafter", 1, 2430, 250, 25)]
    s = bench.summarize(runs)
    assert s["ratios"]["output_tok_s"] == pytest.approx(0.972)
    assert s["verdicts"] == {"throughput": "PASS", "ttft_p99": "PASS", "itl_p99": "PASS"}
    assert s["pass"]
    runs = [_run("no-drafter", 0, 2511, 240, 24), _run("drafter", 1, 2211, 423, 41)]
    s = bench.summarize(runs)  # the issue's numbers at a51a36a
    assert s["verdicts"] == {"throughput": "MISS", "ttft_p99": "MISS", "itl_p99": "MISS"}
    assert not s["pass"]


def test_abba_averages_each_server_and_reports_its_spread() -> None:
    runs = [_run("no-drafter", 0, 2000, 100, 20), _run("drafter", 1, 2000, 100, 20),
            _run("drafter", 2, 1800, 120, 20), _run("no-drafter", 3, 2200, 100, 20)]  # fmt: skip
    s = bench.summarize(runs)
    assert s["servers"]["no-drafter"]["output_tok_s"] == 2100
    assert s["servers"]["drafter"]["runs"] == [1, 2]
    assert s["servers"]["no-drafter"]["spread"]["output_tok_s"] == pytest.approx(200 / 2100)
    assert s["ratios"]["ttft_p99_ms"] == pytest.approx(1.1)
    assert s["verdicts"]["ttft_p99"] == "MISS" and s["verdicts"]["throughput"] == "MISS"


def test_ttft_by_wave_finds_the_opening_bursts_tail() -> None:
    Trace = bench.Trace
    traces = []
    for i, (sent, ttft) in enumerate([(0.0, 0.30), (0.0, 0.02), (0.5, 0.05), (0.6, 0.04)]):
        t = Trace(f"r{i}", "closed", 10 + i, 4, sent)
        t.deltas = [(sent + ttft, 1)]
        traces.append(t)
    waves = bench.ttft_by_wave(traces, concurrency=2)
    assert waves["first_wave"]["n"] == 2 and waves["first_wave"]["max"] == pytest.approx(300)
    assert waves["later"]["max"] == pytest.approx(50)
    assert waves["p99_requests"] == 1 and waves["p99_requests_in_first_wave"] == 1
    traces[2].deltas = [(0.5 + 0.9, 1)]  # now a later request holds the tail
    assert bench.ttft_by_wave(traces, concurrency=2)["p99_requests_in_first_wave"] == 0
    rows = bench.per_request(traces, t_start=0.0)
    assert [r[0] for r in rows] == [0.0, 0.0, 0.5, 0.6] and rows[2] == [0.5, 12, 900.0]


def test_spec_deltas_from_metrics_series() -> None:
    m = 'model="m"'
    before = {f"verifypd_spec_draft_tokens_total{{{m}}}": 10.0,
              f"verifypd_controller_draft_length_count{{{m}}}": 5.0}  # fmt: skip
    after = {
        f"verifypd_spec_draft_tokens_total{{{m}}}": 14.0,
        f"verifypd_spec_accepted_tokens_total{{{m}}}": 1.0,
        f"verifypd_controller_draft_length_count{{{m}}}": 105.0,
        f"verifypd_controller_draft_length_sum{{{m}}}": 4.0,
        f'verifypd_controller_draft_length_bucket{{le="0.0",{m}}}': 99.0,
        f'verifypd_spec_policy_decisions_total{{decision="off_cost",{m}}}': 7.0,
        f'verifypd_spec_policy_decisions_total{{decision="gain_fused",{m}}}': 2.0,
    }
    d = bench.spec_deltas(before, after)
    assert (d["drafted_tokens"], d["accepted_tokens"], d["acceptance_rate"]) == (4.0, 1.0, 0.25)
    assert (d["draft_len_decisions"], d["draft_len_decisions_l0"]) == (100.0, 99.0)
    assert d["mean_draft_len"] == pytest.approx(0.04)
    assert all("_bucket" not in k for k in d["series"])
    assert d["policy_decisions"] == {"gain_fused": 2.0, "off_cost": 7.0}


def test_server_b_speculates_by_prompt_lookup_with_draft_model_ngram() -> None:
    args = bench.parse_args([*TINY[:4], "--draft-model", "ngram", *TINY[6:]])
    on, off = bench.serve_command(args, "drafter", 8000), bench.serve_command(args, "no-drafter", 1)
    assert on[on.index("--spec") + 1] == "ngram" and "--draft-model" not in on
    assert "--spec" not in off
    assert bench.acceptance_label(args).startswith("real (prompt lookup")


def test_the_bench_command_finds_it(capsys) -> None:
    from verifypd.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "spec_off_cost", "--help"])
    assert exit_info.value.code == 0
    assert "Speculation that does not run must cost nothing" in capsys.readouterr().out


class _HeldEngine:
    """Logs each first token; "slow" requests wait 50 ms before theirs, "bad" ones fail
    before any; every request finishes only once ``release`` is set."""

    def __init__(self) -> None:
        self.release, self.log = asyncio.Event(), []

    async def generate(self, request_id, prompt, params):
        if request_id.startswith("bad"):
            raise RuntimeError("rejected")
        if request_id.startswith("slow"):
            await asyncio.sleep(0.05)
        self.log.append(("first", request_id))
        yield SimpleNamespace(new_token_ids=[1], finished=False, finish_reason=None)
        await self.release.wait()
        yield SimpleNamespace(new_token_ids=[2], finished=True, finish_reason="length")


def _opening_wave(names: list[str]) -> tuple[list, list]:
    loadgen = load_bench("loadgen")
    engine = _HeldEngine()

    async def on_wave() -> None:
        engine.log.append(("wave",))
        engine.release.set()

    async def scenario():
        requests = [loadgen.Request(n, "short", 0.0, [1, 2], 2) for n in names]
        return await loadgen.closed_loop(engine, requests, bench.greedy, 2, 10.0, on_wave=on_wave)

    traces, _ = asyncio.run(scenario())
    return traces, engine.log


def test_opening_wave_hook_waits_for_every_first_token_of_the_wave() -> None:
    """``on_wave`` runs once, after every request of the opening wave (the first
    ``concurrency``) has its first token, the slow one's too, and before any request ends."""
    traces, log = _opening_wave(["a", "slow", "c", "d"])
    assert log[:3] == [("first", "a"), ("first", "slow"), ("wave",)]
    assert log.count(("wave",)) == 1
    assert [len(t.deltas) for t in traces] == [2, 2, 2, 2]


def test_opening_wave_hook_counts_a_failed_request_as_done() -> None:
    traces, log = _opening_wave(["bad", "slow", "c"])
    assert log.count(("wave",)) == 1 and log.index(("wave",)) > log.index(("first", "slow"))
    assert traces[0].error == "RuntimeError: rejected" and len(traces[2].deltas) == 2
