"""The ``vllm:`` series of vLLM's Grafana dashboard, scraped from /metrics after requests."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import Harness, bounded

from verifypd.serve.metrics import PrometheusObserver
from verifypd.serve.vllm_metrics import vllm_names

# What the dashboard queries (grafana.json of vLLM's examples), as exported sample names.
DASHBOARD_SERIES = """vllm:e2e_request_latency_seconds_bucket vllm:prompt_tokens_total
vllm:generation_tokens_total vllm:time_per_output_token_seconds_bucket
vllm:num_requests_running vllm:num_requests_waiting vllm:time_to_first_token_seconds_bucket
vllm:gpu_cache_usage_perc vllm:request_prompt_tokens_bucket
vllm:request_generation_tokens_bucket vllm:request_success_total
vllm:request_queue_time_seconds_sum vllm:inter_token_latency_seconds_bucket
vllm:kv_cache_usage_perc vllm:prefix_cache_queries_total vllm:prefix_cache_hits_total
vllm:spec_decode_num_draft_tokens_total vllm:spec_decode_num_accepted_tokens_total
vllm:spec_decode_num_drafts_total vllm:num_preemptions_total""".split()


def samples_of(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@bounded(10)
async def test_vllm_series_after_requests(harness: Harness) -> None:
    for max_tokens in (4, 6):
        payload = {"prompt": "abc", "max_tokens": max_tokens}
        assert (await harness.client.post("/v1/completions", json=payload)).status == 200
    samples = samples_of(await (await harness.client.get("/metrics")).text())
    names = {name for name, _ in samples}
    assert not set(DASHBOARD_SERIES) - names
    for family in vllm_names():
        assert any(name.startswith(family) for name in names), family
    model = (("model_name", "fake-model"),)
    assert samples[("vllm:generation_tokens_total", model)] == 10
    assert samples[("vllm:prompt_tokens_total", model)] == 6
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 2
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 8
    assert samples[("vllm:time_per_output_token_seconds_count", model)] == 8
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 2
    assert samples[("vllm:request_queue_time_seconds_count", model)] == 2
    assert samples[("vllm:request_generation_tokens_sum", model)] == 10
    assert samples[("vllm:request_prompt_tokens_count", model)] == 2
    assert samples[("vllm:prefix_cache_queries_total", model)] == 6
    assert samples[("vllm:spec_decode_num_draft_tokens_total", model)] > 0
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", model)] > 0
    assert samples[("vllm:spec_decode_num_drafts_total", model)] > 0
    success = (("finished_reason", "length"), ("model_name", "fake-model"))
    assert samples[("vllm:request_success_total", success)] == 2
    assert not any(dict(labels).get("finished_reason") == "error" for _, labels in samples)
    assert not any(dict(labels).get("model") for n, labels in samples if n.startswith("vllm:"))


def test_aliases_mirror_the_verifypd_series() -> None:
    observer = PrometheusObserver("m")
    observer.kv_cache(0.25, 30)
    observer.prefix_cache(10, 4)
    observer.preemption()
    observer.requests(3, 5)
    observer.request_finished("error", 1.0, 2, 3)
    observer.request_finished("stop", 1.0, 2, 3)
    samples = samples_of(generate_latest(observer.registry).decode())
    model = (("model_name", "m"),)
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:gpu_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:prefix_cache_hits_total", model)] == 4
    assert samples[("vllm:num_preemptions_total", model)] == 1
    assert samples[("vllm:num_requests_running", model)] == 3
    assert samples[("vllm:num_requests_waiting", model)] == 5
    stop = (("finished_reason", "stop"), ("model_name", "m"))
    assert samples[("vllm:request_success_total", stop)] == 1
    assert samples[("verifypd_requests_finished_total", (("model", "m"), ("reason", "error")))] == 1
    observer.set_model_name("renamed")  # the vLLM series follow the label rebinding
    samples = samples_of(generate_latest(observer.registry).decode())
    assert ("vllm:kv_cache_usage_perc", (("model_name", "renamed"),)) in samples
