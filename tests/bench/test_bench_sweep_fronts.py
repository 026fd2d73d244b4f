"""The rate sweep through other fronts and engines: mixed.py --sweep --http against a real
server (each alpha sent, a cache salt per run, the server's /metrics and timing log) and
--engine-process (a RemoteEngine per mode), with each first token split into its parts; the
server histograms and counters of verifypd and vLLM; peer_vllm.py sweep replaying the same
traces, and vLLM's step log."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_bench, start_server_process, verifypd_serve_command
from sweep_helpers import ROW_KEYS, SWEEP_TINY, count_cache_resets

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_peer_sweep_replays_the_same_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peer_vllm.py sweep (here through verifypd without speculation: the vLLM path differs
    only in its front) replays the plan of a mixed.py sweep JSON with its engine sizes."""
    sweep = load_bench("sweep")
    plan = sweep.SweepPlan(
        mix=sweep.Mix((4, 12), (2, 4), (20, 30), (2, 3), 0.25), vocab=256, seed=1,
        rates=(30.0, 60.0), profiles=("uniform-0.6", "hetero"), temperatures=(0.0, 0.7),
        num_requests=3, run_seconds=0.0, drain_timeout=30.0, slo_ttft_ms=500.0,
        slo_tpot_ms=50.0, burn_in_s=1.0,
    )  # fmt: skip
    ours = {
        "sweep_config": plan.to_dict(),
        "params": {
            "model": "dummy:tiny",
            "num_kv_blocks": 96,
            "max_num_seqs": 4,
            "max_model_len": 128,
            "max_num_batched_tokens": 256,
        },
    }
    src = tmp_path / "ours.json"
    src.write_text(json.dumps(ours))
    resets = count_cache_resets(monkeypatch)
    handed: list[str] = []
    inner = AsyncEngine.generate

    def generate(self, request_id, prompt, params):
        handed.append(request_id.split("-")[0])
        return inner(self, request_id, prompt, params)

    monkeypatch.setattr(AsyncEngine, "generate", generate)
    data = load_bench("peer_vllm").main(
        [
            "sweep",
            "--engine",
            "verifypd",
            "--device",
            "cpu",
            "--from",
            str(src),
            "--out",
            str(tmp_path),
        ]
    )
    assert data["device"] == "cpu" and data["git_commit"]
    assert data["engine_info"]["num_kv_blocks"] == 96 and data["engine_info"]["max_num_seqs"] == 4
    rows = data["sweep"]
    assert len(rows) == 2 * 2 * 2 and {r["mode"] for r in rows} == {"verifypd-off"}
    for r in rows:
        assert r["trace_fingerprint"] == sweep.plan_fingerprint(
            plan, r["rate"], r["acceptance_profile"]
        )
        assert r["num_finished"] == 3
        assert r["ttft_p99_ms"] > 0 and r["goodput_rps"] > 0
    assert (tmp_path / "peer_vllm-cpu-verifypd-sweep.json").is_file()
    assert resets == [0] * 4  # every (rate, temperature) run starts with an empty cache
    # the plan's burn-in (its requests' ids: burn-N) after the warm-up, before the runs
    assert handed == ["warm"] * 16 + ["burn"] * 3 + ["req"] * 12, handed
    assert not any("engine_steps" in r for r in rows)  # vLLM's step log only


def test_vllm_step_log_keeps_each_run_s_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """peer_engines.StepLog (vLLM's per-step stats, peer_vllm.py --trace-steps): a run's steps
    with their times from its start and from the step before; steps outside the run and stats
    without an iteration are dropped; missing fields do not fail the run."""
    peer = load_bench("peer_engines")
    log = peer.StepLog()
    clock = iter([9.0, 10.010, 10.030, 10.032, 11.5])
    monkeypatch.setattr(peer.time, "perf_counter", lambda: next(clock))
    it = lambda gen, ttfts, prompt: SimpleNamespace(  # noqa: E731
        num_generation_tokens=gen, time_to_first_tokens_iter=ttfts, num_prompt_tokens=prompt
    )
    sched = SimpleNamespace(num_running_reqs=3, num_waiting_reqs=1)
    log.record(sched, it(2, [], 0))  # 9.0: before the run
    log.record(sched, it(3, [0.1, 0.2], 2800))  # 10.010
    log.record(None, None)  # no iteration: not a step (no clock read)
    log.record(sched, it(4, [], 0))  # 10.030
    log.record(None, SimpleNamespace())  # 10.032: fields missing
    log.record(sched, it(5, [], 0))  # 11.5: after the run
    steps = log.between(10.0, 11.0)
    assert [s["t_ms"] for s in steps] == [10.0, 30.0, 32.0]
    assert [s["step_ms"] for s in steps] == [None, 20.0, 2.0]
    assert steps[0] == {"t_ms": 10.0, "step_ms": None, "gen_tokens": 3, "prompts_done": 2,
                        "prompt_tokens_done": 2800, "running": 3, "waiting": 1}  # fmt: skip
    assert steps[2]["gen_tokens"] == 0 and steps[2]["running"] is None


def test_http_replay_sends_each_alpha(tmp_path: Path) -> None:
    """mixed.py --sweep --http against a real ``verifypd serve --synthetic-acceptance``: rows in
    the sweep format under --mode-label, each request's alpha sent as a body field (a server
    in synthetic mode accepts it; the same replay without it is refused request by request)."""
    cmd = verifypd_serve_command(
        "--model", "dummy:tiny", "--draft-model", "dummy:tiny", "--device", "cpu",
        "--num-kv-blocks", "256", "--max-model-len", "256", "--synthetic-acceptance", "0.5",
        "--log-request-timing",
    )  # fmt: skip
    argv = [a for a in SWEEP_TINY if a not in ("--num-kv-blocks", "256")]
    argv[argv.index("off,three-fixed,policy")] = "off"  # one mode label; --modes does not apply
    # One profile at two temperatures: the second run of a rate replays the first's prompts.
    argv[argv.index("uniform-0.8,hetero")] = "hetero"
    argv[argv.index("--temperatures") + 1] = "0,0.7"
    with start_server_process(cmd, timeout=120) as server:
        data = load_bench("mixed").main([*argv, "--http", server.url, "--mode-label", "policy",
                                         "--http-extra", '{"user": "sweep"}',
                                         "--out", str(tmp_path)])  # fmt: skip
        # Without a salt per run, the same replay hits the prompts cached at temperature 0.
        unsalted = load_bench("mixed").main([*argv, "--http", server.url, "--mode-label",
                                             "policy", "--no-http-cache-salt", "--rates", "20",
                                             "--out", str(tmp_path / "unsalted")])  # fmt: skip
        server.stop()
        server_log = "\n".join(server.stderr)
    hits = {r["temperature"]: r["server"]["server_prefix_cache_hits_tokens"]
            for r in unsalted["sweep"]}  # fmt: skip
    assert hits[0.0] == 0 and hits[0.7] > 0
    assert unsalted["sweep_engines"]["policy"]["cache_salt_per_run"] is False
    rows = data["sweep"]
    assert [r["server"]["server_prefix_cache_hits_tokens"] for r in rows] == [0.0] * 4
    assert data["sweep_engines"]["policy"]["cache_salt_per_run"] is True
    assert len(rows) == 2 * 2 and {r["mode"] for r in rows} == {"policy"}
    for r in rows:
        assert ROW_KEYS - {"num_drafted", "num_accepted", "num_preemptions", "num_ahead_steps",
                           "num_ahead_held", "num_deltas_ahead",
                           "num_kernel_compiles", "num_decode_rows_fused"} <= set(r)  # fmt: skip
        assert r["server"]["server_kernel_compiles"] == 0.0  # the CPU never compiles
        assert r["server"]["server_decode_rows_fused"] == 0.0  # not set: never fused
        assert r["front"] == "http" and r["num_finished"] == r["num_requests"] > 0
        # The server's own first-token mean, from its /metrics around the run, lies inside
        # the client's (which adds the HTTP front and the network).
        server = r["server"]
        assert 0 < server["server_ttft_mean_ms"] <= server["client_ttft_mean_ms"]
        assert 0 <= server["server_loop_lag_late_share"] <= 1
        assert 0 <= server["server_queue_mean_ms"] <= server["server_ttft_mean_ms"]
    assert data["sweep_engines"]["policy"]["send_alpha"] is True
    info = data["sweep_engines"]["policy"]["server_info"]  # the server's own settings, recorded
    assert info["engine_client"] == "AsyncEngine" and info["engine_config"]["model"] == "dummy:tiny"
    assert info["engine_config"]["cache"]["num_blocks"] == 256
    http = load_bench("http_load").HttpEngine("http://x", "m")
    sent = http.body([1, 2], SamplingParams(max_tokens=2, synthetic_acceptance=0.6))
    assert sent["synthetic_acceptance"] == 0.6
    assert "synthetic_acceptance" not in http.body([1, 2], SamplingParams(max_tokens=2))
    assert http.body([1], SamplingParams(max_tokens=2, cache_salt="s"))["cache_salt"] == "s"
    assert "cache_salt" not in http.body([1], SamplingParams(max_tokens=2))
    assert data["criteria"]["policy_within_5pct_of_best"]["verdict"] == "N/A"
    # Each request's first token, split between the client and the server's timing log.
    log = tmp_path / "server.log"
    log.write_text(server_log)
    times = load_bench("request_times")
    lines = times.server_lines(log)
    for r in rows:
        split = times.splits(r["request_times"], lines)
        assert len(split) == r["num_requests"]
        _parts_add_up(split, times.PARTS, without={"pipe"})  # no engine process here
    (result,) = tmp_path.glob("mixed-*.json")
    split_path = tmp_path / "split.json"
    assert times.main([str(result), "--server-log", str(log), "--top", "2",
                       "--out", str(split_path)]) == 0  # fmt: skip
    split = json.loads(split_path.read_text())["rows"]
    assert len(split) == len(rows) and all(len(r["slowest"]) == 2 for r in split)
    assert split[0]["parts"]["ttft"]["p50"] <= split[0]["parts"]["ttft"]["p90"]
    assert split_path.with_suffix(".png").exists()


def _parts_add_up(split: list[dict], parts: tuple[str, ...], without: set[str]) -> None:
    """Every part of each first token is there (but ``without``), none is negative (one clock
    on one host), and they add up to its TTFT."""
    for row in split:
        assert all(row[p] is None for p in without), row
        got = [row[p] for p in parts if p not in without]
        assert None not in got and min(got) >= -0.01, row
        assert sum(got) == pytest.approx(row["ttft"], abs=0.05), row


def test_server_histogram_totals_of_both_servers() -> None:
    """verifypd's and vLLM's first-token and queue histograms, summed over label sets; the
    means between two scrapes."""
    http = load_bench("http_load")
    page = """# HELP x
verifypd_time_to_first_token_seconds_bucket{le="0.1",model="m"} 3.0
verifypd_time_to_first_token_seconds_sum{model="m"} 0.5
verifypd_time_to_first_token_seconds_count{model="m"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 0.25
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 5.0
verifypd_time_to_first_token_seconds_created{model="m"} 1.7e9
"""
    before = http.histogram_totals(page)
    assert before == {"ttft": (0.5, 4.0), "queue": (0.5, 5.0)}
    after = {"ttft": (0.9, 6.0), "queue": (0.5, 5.0)}
    assert http.server_means(before, after) == {
        "server_ttft_mean_ms": pytest.approx(200.0),
        "server_queue_mean_ms": None,  # no request between the scrapes
    }
    assert http.server_means({}, after) == {}
    counters = """verifypd_prefix_cache_hits_total{model="m"} 32.0
verifypd_prefix_cache_queries_total{model="m"} 80.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
verifypd_kernel_compiles_total{model="m"} 1.0
"""
    totals = http.counter_totals(counters)
    assert totals == {"prefix_cache_hits": 64.0, "prefix_cache_queries": 80.0,
                      "kernel_compiles": 1.0}  # fmt: skip
    later = {"prefix_cache_hits": 64.0, "prefix_cache_queries": 120.0, "kernel_compiles": 3.0}
    assert http.server_means(totals, later) == {
        "server_prefix_cache_hits_tokens": 0.0,
        "server_prefix_cache_queries_tokens": 40.0,
        "server_kernel_compiles": 2.0,
    }
    lag = """verifypd_event_loop_lag_seconds_bucket{le="0.002",model="m"} 70.0
verifypd_event_loop_lag_seconds_bucket{le="0.005",model="m"} 90.0
verifypd_event_loop_lag_seconds_bucket{le="0.01",model="m"} 99.0
verifypd_event_loop_lag_seconds_sum{model="m"} 0.2
verifypd_event_loop_lag_seconds_count{model="m"} 100.0
verifypd_engine_loop_lag_seconds_bucket{le="0.005",model="m"} 48.0
verifypd_engine_loop_lag_seconds_sum{model="m"} 0.1
verifypd_engine_loop_lag_seconds_count{model="m"} 50.0
"""
    first = {**http.histogram_totals(lag), **http.counter_totals(lag)}
    assert first == {"loop_lag": (0.2, 100.0), "loop_lag_on_time": 90.0,
                     "engine_loop_lag": (0.1, 50.0), "engine_loop_lag_on_time": 48.0}  # fmt: skip
    then = {"loop_lag": (0.5, 200.0), "loop_lag_on_time": 150.0,
            "engine_loop_lag": (0.1, 50.0), "engine_loop_lag_on_time": 48.0}  # fmt: skip
    assert http.server_means(first, then) == {
        "server_loop_lag_mean_ms": pytest.approx(3.0),
        "server_loop_lag_late_share": pytest.approx(0.4),  # 40 of 100 probes >= 5 ms late
        "server_engine_loop_lag_mean_ms": None,  # no probe between the two scrapes
        "server_engine_loop_lag_late_share": None,
    }


def test_engine_process_sweep_drives_a_remote_engine(tmp_path: Path) -> None:
    """mixed.py --sweep --engine-process: each mode's engine in its own process (RemoteEngine,
    as vLLM's AsyncLLM runs its core), rows labelled MODE-proc in the sweep format, every
    request finished; each run's requests carry a cache salt of their own."""
    argv = [*SWEEP_TINY, "--out", str(tmp_path), "--engine-process"]
    argv[argv.index("off,three-fixed,policy")] = "off,policy"
    argv[argv.index("uniform-0.8,hetero")] = "hetero"
    argv[argv.index("20,40")] = "20"
    data = load_bench("mixed").main(argv)
    rows = data["sweep"]
    assert [r["mode"] for r in rows] == ["off-proc", "policy-proc"]
    for r in rows:
        assert r["front"] == "engine-process" and r["num_finished"] == r["num_requests"] > 0
        assert r["ttft_p99_ms"] > 0 and r["tpot_p99_ms"] > 0
    engines = data["sweep_engines"]
    assert engines["policy-proc"]["engine_process"] is True and engines["policy-proc"]["controller"]
    # the child's observer calls and policy snapshots cross: spec columns and a timeline
    off, policy = rows
    assert off["num_drafted"] == 0 and off["mean_draft_len_decided"] is None
    assert policy["num_drafted"] > 0 and policy["num_accepted"] <= policy["num_drafted"]
    [timeline] = data["policy_timeline"]
    assert timeline["mode"] == "policy-proc" and timeline["rate"] == 20
    samples = load_bench("sweep_plots").timeline_samples(timeline)
    assert len(samples) >= 2 and samples[-1]["t_s"] > samples[0]["t_s"]
    decided = [sum(v for k, v in t.items() if k.startswith("decisions_")) for t in samples]
    assert decided[-1] > 0 and decided == sorted(decided)  # counted from the run's start
    assert engines["off-proc"]["cache_salt_per_run"] is True
    times = load_bench("request_times")
    for r in rows:  # the RemoteEngine's stamps: no HTTP front, no chunk written
        split = times.splits(r["request_times"], {})
        assert len(split) == r["num_requests"]
        _parts_add_up(split, times.PARTS, without={"to_front", "write"})

    class Recorder:
        def generate(self, request_id, prompt_token_ids, params, timing):
            self.got, self.timing = params, timing
            return "deltas"

    inner = Recorder()
    salted = load_bench("front_sweeps").SaltedEngine(inner, "run-1")
    original = SamplingParams(max_tokens=2, temperature=0.5)
    assert salted.generate("r", [1], original) == "deltas"
    assert inner.got.cache_salt == "run-1" and inner.got.temperature == 0.5
    assert salted.timings["r"] is inner.timing
    assert original.cache_salt is None  # the trace's own params are left as they were
