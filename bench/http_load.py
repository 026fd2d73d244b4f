"""An OpenAI-completions HTTP front with the engine interface of ``loadgen.run_load``: the same
open-loop trace drives ``verifypd serve``, ``vllm serve`` or any OpenAI-compatible server.

Each request is a streaming ``/v1/completions`` call with token-id prompts (``prompt: [ids]``),
greedy or sampled, ``ignore_eos``, ``stream_options.include_usage``. A delta is one SSE chunk
that carries output; its token count is ``len(choices[0].token_ids)`` where the server sends
token ids (``return_token_ids``, honoured by verifypd and vLLM), else 1. Tokens the chunks did
not account for (detokenizers hold back incomplete text, so chunks can merge) are added to the
last delta from the usage count, so TPOT and throughput use the server's own token count.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from verifypd.types import SamplingParams


@dataclass
class HttpDelta:
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


class HttpEngine:
    """``generate(request_id, prompt_ids, params)`` over HTTP, yielding ``HttpDelta``s."""

    def __init__(self, base_url: str, model: str, extra: dict[str, Any] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extra = dict(extra or {})  # server-specific body fields (return_token_ids)
        # Each request goes with ``X-Request-Id: <id_prefix><request id>``: a server that logs
        # it (verifypd serve --log-request-timing) can be lined up with the client, run by run.
        self.id_prefix = ""
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpEngine:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        self.session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "ignore_eos": params.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}, **self.extra,
        }  # fmt: skip
        if params.seed is not None and params.temperature > 0:
            body["seed"] = params.seed
        if params.synthetic_acceptance is not None:  # verifypd in synthetic mode (benchmarks)
            body["synthetic_acceptance"] = params.synthetic_acceptance
        if params.cache_salt is not None:  # vLLM's and verifypd's: a prefix cache of its own
            body["cache_salt"] = params.cache_salt
        return body

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[HttpDelta]:
        assert self.session is not None, "use HttpEngine as an async context manager"
        url = f"{self.base_url}/v1/completions"
        seen, finish = 0, None
        headers = {"X-Request-Id": self.id_prefix + request_id}
        async with self.session.post(url, json=self.body(prompt, params), headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for chunk in sse_events(resp):
                usage = chunk.get("usage")
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                    if n:
                        seen += n
                        yield HttpDelta([0] * n)
                if usage and usage.get("completion_tokens") is not None:
                    missing = int(usage["completion_tokens"]) - seen
                    yield HttpDelta([0] * max(0, missing), True, finish or "length")
                    return
        yield HttpDelta([], True, finish or "length")


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream, up to ``data: [DONE]``."""
    async for raw in resp.content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


# The server's own histograms of a request's first token and of its wait before its first
# schedule, as verifypd and vLLM name them in their Prometheus metrics.
SERVER_HISTOGRAMS = {
    "ttft": ("verifypd_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "queue": ("verifypd_request_queue_seconds", "vllm:request_queue_time_seconds"),
    # verifypd only: how late its event loop (the engine's and the HTTP front's) woke; with
    # --engine-process that is the front's, and the engine process's is its own histogram
    "loop_lag": ("verifypd_event_loop_lag_seconds",),
    "engine_loop_lag": ("verifypd_engine_loop_lag_seconds",),
}
LOOP_LAGS = ("loop_lag", "engine_loop_lag")  # their late shares go in each row too
LATE_LOOP_S = "0.005"  # the loop-lag bucket bound: a probe past it held the loop >= 5 ms


# Counters of prompt tokens looked up in / found in the server's prefix cache (both servers
# count tokens): a run's hits show whether it replayed prompts the server had cached.
SERVER_COUNTERS = {
    "prefix_cache_hits": ("verifypd_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "prefix_cache_queries": (
        "verifypd_prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
    ),
    "kernel_compiles": ("verifypd_kernel_compiles_total",),  # under traffic: each a stall
    "decode_rows_fused": ("verifypd_decode_rows_fused_total",),  # --fuse-decode-backlog-s
}
# The unit a counter's increase is named with in a row's ``server`` (server_<key><unit>).
COUNTER_UNITS = {"prefix_cache_hits": "_tokens", "prefix_cache_queries": "_tokens"}


def _samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(name with labels, metric name, value) of each sample line of a Prometheus text page."""
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            yield name, name.split("{", 1)[0], float(value)


def counter_totals(text: str) -> dict[str, float]:
    """Each ``SERVER_COUNTERS`` entry of a Prometheus text page, summed over its label sets;
    an entry the page lacks is left out."""
    totals: dict[str, float] = {}
    for name, base, value in _samples(text):
        for key, names in SERVER_COUNTERS.items():
            if base in names:
                totals[key] = totals.get(key, 0.0) + value
        for key in LOOP_LAGS:
            (metric,) = SERVER_HISTOGRAMS[key]
            if base == f"{metric}_bucket" and f'le="{LATE_LOOP_S}"' in name:
                totals[f"{key}_on_time"] = totals.get(f"{key}_on_time", 0.0) + value
    return totals


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ``SERVER_HISTOGRAMS`` entry in a Prometheus text page, summed over
    its label sets; an entry the page lacks is left out."""
    totals: dict[str, list[float]] = {}
    for _, base, value in _samples(text):
        for key, names in SERVER_HISTOGRAMS.items():
            for n in names:
                for i, suffix in enumerate(("_sum", "_count")):
                    if base == n + suffix:
                        totals.setdefault(key, [0.0, 0.0])[i] += value
    return {k: (v[0], v[1]) for k, v in totals.items()}


async def server_totals(base_url: str) -> dict[str, Any]:
    """``histogram_totals`` and ``counter_totals`` of ``GET /metrics``; empty where the server
    has no such page."""
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base_url.rstrip('/')}/metrics") as resp:
                if resp.status != 200:
                    return {}
                text = await resp.text()
                return {**histogram_totals(text), **counter_totals(text)}
    except aiohttp.ClientError:
        return {}


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    """Between two ``server_totals``: the mean ms of each histogram over its requests (or its
    probes), each counter's increase (``server_prefix_cache_hits_tokens``, ...) and the share of
    event-loop probes that woke ``LATE_LOOP_S`` or more late (verifypd's)."""
    out: dict[str, float | None] = {}
    for key in SERVER_HISTOGRAMS:
        if key in before and key in after:
            d_sum, d_count = (a - b for a, b in zip(after[key], before[key], strict=True))
            out[f"server_{key}_mean_ms"] = d_sum / d_count * 1e3 if d_count > 0 else None
    for key in SERVER_COUNTERS:
        if key in before and key in after:
            out[f"server_{key}{COUNTER_UNITS.get(key, '')}"] = after[key] - before[key]
    for key in LOOP_LAGS:
        on_time = f"{key}_on_time"
        if on_time in before and on_time in after and key in after and key in before:
            probes = after[key][1] - before[key][1]
            late = probes - (after[on_time] - before[on_time])
            out[f"server_{key}_late_share"] = late / probes if probes > 0 else None
    return out


async def server_info(base_url: str) -> dict[str, Any] | None:
    """``GET /server_info``: how the server runs (verifypd's every engine and server setting;
    vLLM answers it only in its developer mode). None where it does not answer."""
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base_url.rstrip('/')}/server_info") as resp:
                return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


async def served_model(base_url: str) -> str:
    """The first model id of ``GET /v1/models``."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url.rstrip('/')}/v1/models") as resp:
            return (await resp.json())["data"][0]["id"]


async def wait_ready(base_url: str, timeout_s: float, proc: Any = None) -> None:
    """Poll ``GET /health`` until 200; fail early if ``proc`` (a Popen) exits."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                async with session.get(f"{base_url.rstrip('/')}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await _sleep(0.5)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
