"""The ``vllm:`` metric names that vLLM's Grafana dashboard reads, beside the ``verifypd_`` ones.

Nothing is counted twice: :class:`VllmAliases` is a collector that, at scrape time, re-emits the
samples of the ``verifypd_`` families under vLLM's names, with the label ``model`` renamed to
``model_name`` (and ``reason`` to ``finished_reason``). Only what verifypd does not count yet
is observed here, once per request or per verify round, never per token: the prompt and
generation length histograms and the number of drafts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from prometheus_client.metrics import MetricWrapperBase

PREFIX = "vllm:"
SOURCE_PREFIX = "verifypd_"
LABELS = {"model": "model_name", "reason": "finished_reason"}
SUCCESS_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason values; "error" is not
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# vLLM name -> verifypd name (without prefixes)
ALIASES: dict[str, str] = {
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "time_per_output_token_seconds": "inter_token_latency_seconds",  # the older dashboard's name
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_seconds",
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_ratio",  # a fraction in [0, 1], as in vLLM
    "gpu_cache_usage_perc": "kv_cache_usage_ratio",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "spec_decode_num_draft_tokens": "spec_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_accepted_tokens",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "requests_finished",
    "num_preemptions": "preemptions",
}

# Observed here (vLLM name -> kind, help, buckets).
OWN: dict[str, tuple[type, str, tuple[float, ...] | None]] = {
    "spec_decode_num_drafts": (Counter, "Verify rounds of speculating sequences", None),
    "request_prompt_tokens": (Histogram, "Prompt tokens per finished request", LENGTH_BUCKETS),
    "request_generation_tokens": (
        Histogram, "Generated tokens per finished request", LENGTH_BUCKETS,
    ),
}  # fmt: skip


def vllm_names() -> list[str]:
    """The vLLM metric family names exported (counters without their ``_total``)."""
    return [PREFIX + name for name in (*ALIASES, *OWN)]


class VllmAliases:
    """Scrape-time view of ``families`` (the observer's verifypd families) under vLLM names."""

    def __init__(self, families: dict[str, MetricWrapperBase]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for name, source in ALIASES.items():
            for family in self._families[source].collect():
                yield _renamed(family, SOURCE_PREFIX + source, PREFIX + name)


def _renamed(family: Metric, old: str, new: str) -> Metric:
    metric = Metric(new, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = {LABELS.get(k, k): v for k, v in sample.labels.items()}
        if labels.get("finished_reason") not in (None, *SUCCESS_REASONS):
            continue  # vllm:request_success counts no failed requests
        metric.samples.append(sample._replace(name=new + sample.name[len(old) :], labels=labels))
    return metric


class VllmMetrics:
    """The vLLM-only series, plus the alias collector, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, families: dict[str, MetricWrapperBase]) -> None:
        self._own = {
            name: kind(PREFIX + name, doc, ["model_name"], registry=registry,
                       **({"buckets": buckets} if buckets else {}))
            for name, (kind, doc, buckets) in OWN.items()
        }  # fmt: skip
        self._m: dict[str, MetricWrapperBase] = {}
        registry.register(VllmAliases(families))

    def set_model_name(self, model_name: str) -> None:
        for name, family in self._own.items():
            family.clear()
            self._m[name] = family.labels(model_name=model_name)

    def request_finished(self, num_prompt: int, num_generated: int) -> None:
        self._m["request_prompt_tokens"].observe(num_prompt)
        self._m["request_generation_tokens"].observe(num_generated)

    def draft_verified(self) -> None:
        self._m["spec_decode_num_drafts"].inc()
