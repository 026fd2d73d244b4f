"""Prometheus metrics: an Observer that the engine calls, exporting the stable metric names.

Every metric is named ``verifypd_<name>`` and carries the label ``model``; the same series are
also exported under vLLM's ``vllm:`` names (see vllm_metrics.py). Each observer owns its own
CollectorRegistry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from verifypd.serve.live import MAX_DRAFT_LEN, LiveStats
from verifypd.serve.vllm_metrics import VllmMetrics
from verifypd.types import Observer

PREFIX = "verifypd_"
LANES = ("prefill", "decode", "verify")
FINISH_REASONS = ("stop", "length", "abort", "error")

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # fmt: skip
TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384
DRAFT_BUCKETS = tuple(float(i) for i in range(MAX_DRAFT_LEN + 1))  # L = 0 .. 16
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0, 40.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.25, 0.5, 1.0)  # fmt: skip
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DECIDE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# name -> (kind, help, extra label, buckets)
METRICS: dict[str, tuple[type, str, str | None, tuple[float, ...] | None]] = {
    "lane_queue_depth": (Gauge, "Work items queued per lane", "lane", None),
    "lane_step_seconds": (Histogram, "Wall time of one lane step", "lane", STEP_BUCKETS),
    "lane_batch_tokens": (Histogram, "Tokens in one lane step", "lane", TOKEN_BUCKETS),
    "controller_draft_length": (
        Histogram,
        "Draft length L of each decode step's speculating set (0: none)",
        None,
        DRAFT_BUCKETS,
    ),
    "controller_drafter_temperature": (Gauge, "Drafter temperature", None, None),
    "spec_policy_decisions": (
        Counter,
        "Speculation policy decisions (one per decode step), by reason",
        "decision",
        None,
    ),
    "spec_policy_decide_seconds": (
        Histogram,
        "Host time of one speculation policy decision (the event loop waits for it)",
        None,
        DECIDE_BUCKETS,
    ),
    "spec_draft_tokens": (Counter, "Draft tokens proposed", None, None),
    "spec_accepted_tokens": (Counter, "Draft tokens accepted", None, None),
    "spec_draft_misses": (
        Counter,
        "Rows given a draft length whose proposer found nothing to draft (a prompt lookup "
        "without a match); they decoded plainly",
        None,
        None,
    ),
    "spec_drafter_prompt_tokens": (
        Counter,
        "Prompt tokens the drafter was fed behind prefill steps (SpecConfig.follow_prefill)",
        None,
        None,
    ),
    "time_to_first_token_seconds": (Histogram, "Time to first token", None, TTFT_BUCKETS),
    "inter_token_latency_seconds": (Histogram, "Time between tokens", None, ITL_BUCKETS),
    "e2e_request_latency_seconds": (Histogram, "Request latency", None, E2E_BUCKETS),
    "request_queue_seconds": (Histogram, "Time waiting before first schedule", None, TTFT_BUCKETS),
    "num_requests_running": (Gauge, "Sequences running", None, None),
    "num_requests_waiting": (Gauge, "Sequences waiting", None, None),
    "kv_cache_usage_ratio": (Gauge, "Fraction of KV blocks in use", None, None),
    "kv_blocks_free": (Gauge, "Free KV blocks", None, None),
    "prefix_cache_queries": (Counter, "Prompt tokens looked up in the prefix cache", None, None),
    "prefix_cache_hits": (Counter, "Prompt tokens found in the prefix cache", None, None),
    "preemptions": (Counter, "Sequences preempted", None, None),
    "decode_ahead_steps": (
        Counter,
        "Decode steps launched while the step before them still ran",
        None,
        None,
    ),
    "prompt_ahead_steps": (
        Counter,
        "Prompt steps launched while the one before them still ran (EngineConfig.prompt_ahead)",
        None,
        None,
    ),
    "prompts_in_decode": (
        Counter,
        "Prompts computed inside a decode step (EngineConfig.prompt_in_decode_tokens)",
        None,
        None,
    ),
    "decode_rows_fused": (
        Counter,
        "Decode rows computed inside prompt steps (EngineConfig.fuse_decode_backlog_s)",
        None,
        None,
    ),
    "kernel_compiles": (
        Counter,
        "Triton kernels compiled after start-up, each a stall of every lane (engine.compile_watch)",
        None,
        None,
    ),
    "requests_finished": (Counter, "Requests finished, by reason", "reason", None),
    "prompt_tokens": (Counter, "Prompt tokens of finished requests", None, None),
    "generation_tokens": (Counter, "Generated tokens of finished requests", None, None),
    # The server's event loop (serve.loop_health): how late a 10 ms sleep wakes, and every
    # garbage collection's pause, by generation.
    "event_loop_lag_seconds": (
        Histogram,
        "How much later than asked the server's event loop woke",
        None,
        LAG_BUCKETS,
    ),
    "gc_pause_seconds": (
        Histogram,
        "Garbage-collection pauses of the server process",
        "generation",
        LAG_BUCKETS,
    ),
    # With --engine-process: the same probe on the engine process's own loop.
    "engine_loop_lag_seconds": (
        Histogram,
        "How much later than asked the engine process's event loop woke (--engine-process)",
        None,
        LAG_BUCKETS,
    ),
}
# The goodput policy's reasons for speculating nobody (verifypd.controller.goodput.REASONS);
# a speculating step is counted as speculate|catch_up|probe with _fused or _separate.
POLICY_OFF_REASONS = ("no_gain", "no_candidates", "latency_guard", "prefill_pressure",
                      "prefill_running", "batch_too_large", "tail_budget")  # fmt: skip
PRESET_LABELS = {"lane": LANES, "reason": FINISH_REASONS, "decision": POLICY_OFF_REASONS,
                 "generation": ("0", "1", "2")}  # fmt: skip


def exported_names() -> list[str]:
    """Full metric names as they appear in /metrics (counters get their ``_total``)."""
    return [PREFIX + n + ("_total" if kind is Counter else "") for n, (kind, *_) in METRICS.items()]


def _define(registry: CollectorRegistry) -> dict[str, MetricWrapperBase]:
    families = {}
    for name, (kind, doc, extra, buckets) in METRICS.items():
        labels = ["model"] + ([extra] if extra else [])
        kwargs = {"buckets": buckets} if buckets else {}
        families[name] = kind(PREFIX + name, doc, labels, registry=registry, **kwargs)
    return families


class PrometheusObserver(Observer):
    """Engine observer exporting Prometheus metrics and feeding the dashboard's LiveStats."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.live = LiveStats()
        self._families = _define(self.registry)
        self.vllm = VllmMetrics(self.registry, self._families)
        self._m: dict[str, MetricWrapperBase] = {}
        self.model_name = ""
        self.set_model_name(model_name)

    def set_model_name(self, model_name: str) -> None:
        """(Re)bind the ``model`` label; used once the engine has loaded and knows its name."""
        if model_name == self.model_name:
            return
        self.model_name = model_name
        self.vllm.set_model_name(model_name)
        for name, family in self._families.items():
            family.clear()
            extra = METRICS[name][2]
            if extra is None:
                self._m[name] = family.labels(model=model_name)
            for value in PRESET_LABELS.get(extra, ()):
                family.labels(model=model_name, **{extra: value})

    def _labeled(self, name: str, **labels: str) -> MetricWrapperBase:
        return self._families[name].labels(model=self.model_name, **labels)

    # -- Observer hooks ------------------------------------------------------------------

    def loop_lag(self, seconds: float) -> None:
        self._m["event_loop_lag_seconds"].observe(seconds)

    def engine_loop_lag(self, seconds: float) -> None:
        self._m["engine_loop_lag_seconds"].observe(seconds)

    def gc_pause(self, generation: int, seconds: float) -> None:
        self._labeled("gc_pause_seconds", generation=str(generation)).observe(seconds)

    def lane_step(self, lane: str, seconds: float, num_tokens: int) -> None:
        self._labeled("lane_step_seconds", lane=lane).observe(seconds)
        self._labeled("lane_batch_tokens", lane=lane).observe(num_tokens)
        self.live.lane_step(lane, seconds, num_tokens)

    def queue_depths(self, depths: dict[str, int]) -> None:
        for lane, depth in depths.items():
            self._labeled("lane_queue_depth", lane=lane).set(depth)
        self.live.queue_depths = dict(depths)

    def requests(self, num_running: int, num_waiting: int) -> None:
        self._m["num_requests_running"].set(num_running)
        self._m["num_requests_waiting"].set(num_waiting)
        self.live.num_running, self.live.num_waiting = num_running, num_waiting

    def request_queued(self, seconds: float) -> None:
        self._m["request_queue_seconds"].observe(seconds)
        self.live.queue.add(seconds)

    def first_token(self, seconds: float) -> None:
        self._m["time_to_first_token_seconds"].observe(seconds)
        self.live.ttft.add(seconds)
        self.live.totals["output_tokens"] += 1

    def inter_token(self, seconds: float) -> None:
        self._m["inter_token_latency_seconds"].observe(seconds)
        self.live.itl.add(seconds)
        self.live.totals["output_tokens"] += 1

    def request_finished(
        self, reason: str, e2e_seconds: float, num_prompt: int, num_generated: int
    ) -> None:
        self._labeled("requests_finished", reason=reason).inc()
        self._m["e2e_request_latency_seconds"].observe(e2e_seconds)
        self._m["prompt_tokens"].inc(num_prompt)
        self._m["generation_tokens"].inc(num_generated)
        self.vllm.request_finished(num_prompt, num_generated)
        self.live.e2e.add(e2e_seconds)
        self.live.request_finished(reason, num_prompt, num_generated)

    def spec_tokens(self, num_drafted: int, num_accepted: int) -> None:
        self._m["spec_draft_tokens"].inc(num_drafted)
        self._m["spec_accepted_tokens"].inc(num_accepted)
        self.vllm.draft_verified()
        self.live.spec_tokens(num_drafted, num_accepted)

    def draft_missed(self) -> None:
        self._m["spec_draft_misses"].inc()

    def draft_length(self, draft_len: int) -> None:
        self._m["controller_draft_length"].observe(draft_len)
        self.live.draft_lengths.add(draft_len)

    def spec_decision(self, reason: str, fused: bool, draft_len: int) -> None:
        decision = f"{reason}_{'fused' if fused else 'separate'}" if draft_len else reason
        self._labeled("spec_policy_decisions", decision=decision).inc()

    def policy_decide(self, seconds: float) -> None:
        self._m["spec_policy_decide_seconds"].observe(seconds)

    def drafter_temperature(self, temperature: float) -> None:
        self._m["controller_drafter_temperature"].set(temperature)
        self.live.drafter_temperature = temperature

    def kv_cache(self, usage_ratio: float, num_free_blocks: int) -> None:
        self._m["kv_cache_usage_ratio"].set(usage_ratio)
        self._m["kv_blocks_free"].set(num_free_blocks)
        self.live.kv_usage, self.live.kv_blocks_free = usage_ratio, num_free_blocks

    def prefix_cache(self, num_queries: int, num_hits: int) -> None:
        self._m["prefix_cache_queries"].inc(num_queries)
        self._m["prefix_cache_hits"].inc(num_hits)
        self.live.totals["prefix_queries"] += num_queries
        self.live.totals["prefix_hits"] += num_hits

    def decode_ahead(self) -> None:
        self._m["decode_ahead_steps"].inc()

    def prompt_ahead(self) -> None:
        self._m["prompt_ahead_steps"].inc()

    def prompt_in_decode(self) -> None:
        self._m["prompts_in_decode"].inc()

    def decode_fused(self, num_rows: int) -> None:
        self._m["decode_rows_fused"].inc(num_rows)

    def kernel_compiled(self, name: str) -> None:
        self._m["kernel_compiles"].inc()

    def drafter_prompt_tokens(self, num_tokens: int) -> None:
        self._m["spec_drafter_prompt_tokens"].inc(num_tokens)

    def preemption(self) -> None:
        self._m["preemptions"].inc()
        self.live.totals["preemptions"] += 1

    # -- Pull-side refresh ---------------------------------------------------------------

    def sample_engine(
        self, num_running: int, num_waiting: int, kv_usage: float, kv_blocks_free: int
    ) -> None:
        """Refresh the gauges from the engine's own counters (called before each scrape):
        an abort frees blocks without a step, and steps are what report them otherwise."""
        self.requests(num_running, num_waiting)
        self.kv_cache(kv_usage, kv_blocks_free)
