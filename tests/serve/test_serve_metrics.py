"""Prometheus metrics, the dashboard page and its data, and the deploy/ files."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from server_utils import Harness, bounded

from verifypd.serve.live import percentiles
from verifypd.serve.metrics import METRICS, PrometheusObserver, exported_names

ROOT = Path(__file__).resolve().parents[2]
STABLE_NAMES = """lane_queue_depth lane_step_seconds lane_batch_tokens controller_draft_length
controller_drafter_temperature spec_policy_decisions_total spec_policy_decide_seconds
spec_draft_tokens_total
spec_accepted_tokens_total spec_draft_misses_total spec_drafter_prompt_tokens_total
time_to_first_token_seconds inter_token_latency_seconds e2e_request_latency_seconds
request_queue_seconds num_requests_running num_requests_waiting kv_cache_usage_ratio
kv_blocks_free prefix_cache_queries_total prefix_cache_hits_total preemptions_total
decode_ahead_steps_total prompt_ahead_steps_total prompts_in_decode_total
decode_rows_fused_total kernel_compiles_total
requests_finished_total
prompt_tokens_total
generation_tokens_total event_loop_lag_seconds gc_pause_seconds engine_loop_lag_seconds""".split()


def test_exported_names_match_the_stable_contract() -> None:
    assert exported_names() == ["verifypd_" + n for n in STABLE_NAMES]


@bounded(10)
async def test_metrics_endpoint_has_every_metric(harness: Harness) -> None:
    payload = {"prompt": "abc", "max_tokens": 4}
    assert (await harness.client.post("/v1/completions", json=payload)).status == 200
    resp = await harness.client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    for name in exported_names():
        assert re.search(rf"^{name}(_bucket|_count|_sum)?{{", text, re.M), name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    model = ("model", "fake-model")
    assert samples[("verifypd_generation_tokens_total", (model,))] == 4
    assert samples[("verifypd_prompt_tokens_total", (model,))] == 3
    assert samples[("verifypd_requests_finished_total", (model, ("reason", "length")))] == 1
    assert samples[("verifypd_time_to_first_token_seconds_count", (model,))] == 1
    assert samples[("verifypd_inter_token_latency_seconds_count", (model,))] == 3
    assert samples[("verifypd_prefix_cache_queries_total", (model,))] == 3
    for lane in ("prefill", "decode", "verify"):
        assert samples[("verifypd_lane_step_seconds_count", (("lane", lane), model))] > 0
    assert samples[("verifypd_kv_cache_usage_ratio", (model,))] == 0.0


def test_observer_semantics_and_separate_registries() -> None:
    a, b = PrometheusObserver("m1"), PrometheusObserver("m2")  # no duplicate-name clash
    a.prefix_cache(10, 4)
    a.prefix_cache(6, 6)  # increments add up
    a.kv_cache(0.25, 30)
    a.kv_cache(0.5, 20)  # gauges hold the latest value
    a.requests(3, 1)
    a.draft_length(16)
    a.draft_length(0)
    a.spec_tokens(8, 6)
    a.draft_missed()
    a.draft_missed()
    a.policy_decide(0.0003)
    a.policy_decide(0.004)
    get = a.registry.get_sample_value
    assert get("verifypd_spec_policy_decide_seconds_count", {"model": "m1"}) == 2
    assert get("verifypd_spec_policy_decide_seconds_sum", {"model": "m1"}) == 0.0043
    assert get("verifypd_spec_policy_decide_seconds_bucket", {"model": "m1", "le": "0.0005"}) == 1
    assert get("verifypd_prefix_cache_queries_total", {"model": "m1"}) == 16
    assert get("verifypd_spec_draft_misses_total", {"model": "m1"}) == 2
    assert get("verifypd_prefix_cache_hits_total", {"model": "m1"}) == 10
    assert get("verifypd_kv_cache_usage_ratio", {"model": "m1"}) == 0.5
    assert get("verifypd_kv_blocks_free", {"model": "m1"}) == 20
    assert get("verifypd_num_requests_running", {"model": "m1"}) == 3
    assert get("verifypd_controller_draft_length_bucket", {"model": "m1", "le": "0.0"}) == 1
    assert get("verifypd_controller_draft_length_bucket", {"model": "m1", "le": "16.0"}) == 2
    assert b.registry.get_sample_value("verifypd_kv_blocks_free", {"model": "m2"}) == 0
    live = a.live.snapshot()
    assert live["acceptance_rate"] == 0.75 and live["draft_length_counts"][16] == 1
    a.set_model_name("renamed")
    assert get("verifypd_kv_blocks_free", {"model": "m1"}) is None
    assert get("verifypd_kv_blocks_free", {"model": "renamed"}) == 0
    assert set(METRICS) == {n.removesuffix("_total") for n in STABLE_NAMES}


def test_percentiles_nearest_rank() -> None:
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    values = [float(i) for i in range(1, 101)]
    assert percentiles(values) == {"p50": 51.0, "p95": 96.0, "p99": 100.0}


@bounded(10)
async def test_dashboard_is_self_contained(harness: Harness) -> None:
    resp = await harness.client.get("/dashboard")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html")
    html = await resp.text()
    assert "<canvas" in html and "/dashboard/data" in html
    links = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html, re.I)
    assert all(not re.match(r"^(https?:)?//", link) for link in links), links
    assert not re.search(r"https?://", html)  # no external URL at all (no CDN, no fonts)
    assert "@import" not in html and "url(" not in html


@bounded(10)
async def test_dashboard_data_and_history(harness: Harness) -> None:
    payload = {"prompt": "abc", "max_tokens": 20, "stream": True}
    resp = await harness.client.post("/v1/completions", json=payload)
    assert (await resp.text()).endswith("data: [DONE]\n\n")
    data = await (await harness.client.get("/dashboard/data")).json()
    assert data["model"] == "fake-model" and data["phase"] == "ready"
    assert data["max_queue"] == 64 and data["inflight"] == 0
    assert set(data["lanes"]) == {"prefill", "decode", "verify"}
    decode = data["lanes"]["decode"]
    assert decode["step_p50"] > 0 and decode["step_p95"] >= decode["step_p50"]
    assert data["ttft"]["p50"] > 0 and data["itl"]["p95"] > 0
    assert len(data["draft_length_counts"]) == 17 and sum(data["draft_length_counts"]) > 0
    assert 0 < data["acceptance_rate"] <= 1 and data["totals"]["output_tokens"] == 20
    await asyncio.sleep(1.2)  # the history sampler runs once a second
    history = await (await harness.client.get("/dashboard/history")).json()
    assert history["interval_s"] == 1.0 and len(history["snapshots"]) >= 1
    assert history["snapshots"][-1]["totals"]["output_tokens"] == 20


def test_grafana_dashboard_covers_every_metric() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["schemaVersion"] >= 30 and dashboard["panels"]
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for name in exported_names():
        assert name in exprs, name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
            "w"
        ] <= 24


def test_grafana_dashboard_is_generated() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen", ROOT / "deploy" / "make_grafana_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    assert module.dashboard() == committed  # regenerate with deploy/make_grafana_dashboard.py


def test_prometheus_config_scrapes_metrics() -> None:
    text = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in text and '"localhost:8000"' in text
    assert "job_name: verifypd" in text
