"""Load generators for ``AsyncEngine`` (in-process, or over HTTP through ``http_load``) and the
client-side latency statistics of ``mixed.py``: seeded Poisson arrivals of short and long
requests (open loop) or a fixed number of clients (closed loop), one ``Trace`` per request (the
time and size of every delta), TTFT / ITL / TPOT / e2e percentiles.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from verifypd.types import SamplingParams


# ----------------------------------------------------------------------------- requests
@dataclass
class Request:
    request_id: str
    kind: str  # short | long
    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Mix:
    """Request mix: [lo, hi] token ranges per kind and the share of long requests."""

    short_prompt: tuple[int, int]
    short_output: tuple[int, int]
    long_prompt: tuple[int, int]
    long_output: tuple[int, int]
    long_fraction: float


def make_requests(
    mix: Mix,
    vocab: int,
    seed: int,
    count: int,
    rate: float | None,
    duration_s: float = 0.0,
    prefix: str = "req",
) -> list[Request]:
    """Seeded open-loop arrivals: exponential gaps at ``rate`` (all at 0 if None), at most
    ``count`` requests, none after ``duration_s`` (0 = no limit); random prompt ids < vocab."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for i in range(count):
        t += rng.exponential(1.0 / rate) if rate else 0.0
        if rate and duration_s and t > duration_s:
            break
        kind = "long" if rng.random() < mix.long_fraction else "short"
        plen = _draw(rng, getattr(mix, f"{kind}_prompt"))
        olen = _draw(rng, getattr(mix, f"{kind}_output"))
        prompt = rng.integers(0, vocab, plen).tolist()
        out.append(Request(f"{prefix}-{i}", kind, t, prompt, olen))
    return out


def _draw(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


# ----------------------------------------------------------------------------- client side
@dataclass
class Trace:
    """What the client saw of one request (perf_counter seconds)."""

    request_id: str
    kind: str
    prompt_len: int
    max_tokens: int
    arrival: float  # intended arrival time (open loop)
    sent: float | None = None  # when the client called ``generate`` (its loop may be late)
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (time, num new tokens)
    finish_time: float | None = None
    finish_reason: str | None = None  # None: unfinished when the drain timeout hit
    error: str | None = None

    @property
    def num_output(self) -> int:
        return sum(n for _, n in self.deltas)

    @property
    def ttft_s(self) -> float | None:
        return self.deltas[0][0] - self.arrival if self.deltas else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival

    @property
    def tpot_s(self) -> float | None:
        if self.finish_time is None or self.num_output < 2:
            return None
        return (self.deltas[-1][0] - self.deltas[0][0]) / (self.num_output - 1)

    def gaps(self) -> list[tuple[float, int]]:
        """(seconds since the previous delta, tokens in this delta) after the first delta."""
        pairs = zip(self.deltas, self.deltas[1:], strict=False)
        return [(t1 - t0, n) for (t0, _), (t1, n) in pairs]

    def itl_samples(self) -> list[float]:
        return [gap / n for gap, n in self.gaps() for _ in range(n)]

    def row(self) -> dict[str, Any]:
        gaps = [g for g, _ in self.gaps()]
        return {
            "request_id": self.request_id, "kind": self.kind, "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens, "num_output": self.num_output,
            "finish_reason": self.finish_reason, "error": self.error, "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "max_gap_s": max(gaps, default=None),
        }  # fmt: skip


async def consume(engine, req: Request, trace: Trace, params: SamplingParams) -> None:
    trace.sent = time.perf_counter()
    try:
        async for out in engine.generate(req.request_id, req.prompt, params):
            now = time.perf_counter()
            if out.new_token_ids:
                trace.deltas.append((now, len(out.new_token_ids)))
            if out.finished:
                trace.finish_time, trace.finish_reason = now, out.finish_reason
    except Exception as exc:  # noqa: BLE001 - a rejected request is a result, not a crash
        trace.error = f"{type(exc).__name__}: {exc}"


async def run_load(
    engine,
    requests: list[Request],
    params_of: Callable[[int, Request], SamplingParams],
    drain_timeout_s: float,
) -> tuple[list[Trace], float]:
    """Open loop: submits each request at its arrival time whatever the engine is doing; after
    the last arrival waits up to ``drain_timeout_s``, then aborts what is left (unfinished)."""
    t_start = time.perf_counter()
    traces = [Trace(r.request_id, r.kind, len(r.prompt), r.max_tokens, t_start + r.arrival_s)
              for r in requests]  # fmt: skip
    tasks = []
    for i, (req, trace) in enumerate(zip(requests, traces, strict=True)):
        delay = trace.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(consume(engine, req, trace, params_of(i, req))))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in pending:
            task.cancel()  # leaving the iterator aborts the request
        await asyncio.gather(*tasks, return_exceptions=True)
    return traces, t_start


async def closed_loop(
    engine,
    requests: list[Request],
    params_of: Callable[[Request], SamplingParams],
    concurrency: int,
    timeout: float,
    on_wave: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[Trace], float]:
    """Closed loop: ``concurrency`` clients, each sending its next request when the last one
    finished; a request's TTFT counts from when it was sent. ``on_wave``: awaited once every
    request of the opening wave (the first ``concurrency``) has its first token or has failed.
    Returns (traces, start time)."""
    t_start = time.perf_counter()
    traces = [Trace(r.request_id, r.kind, len(r.prompt), r.max_tokens, t_start) for r in requests]
    gate = asyncio.Semaphore(concurrency)
    watcher = asyncio.create_task(after_wave(traces[:concurrency], on_wave)) if on_wave else None

    async def one(req: Request, trace: Trace) -> None:
        async with gate:
            trace.arrival = time.perf_counter()
            await consume(engine, req, trace, params_of(req))

    tasks = [asyncio.create_task(one(r, t)) for r, t in zip(requests, traces, strict=True)]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if watcher is not None:
        if not watcher.done():  # a request of the wave never answered (timeout, cancelled)
            watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return traces, t_start


async def after_wave(
    wave: list[Trace], on_wave: Callable[[], Awaitable[None]], poll_s: float = 0.002
) -> None:
    """Awaits ``on_wave()`` once every trace of ``wave`` has a token or an error."""
    while not all(t.deltas or t.error or t.finish_time for t in wave):
        await asyncio.sleep(poll_s)
    await on_wave()


# ----------------------------------------------------------------------------- statistics
def pcts(values: list[float | None]) -> dict[str, Any]:
    """ms percentiles of seconds."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64) * 1e3
    if not a.size:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    q = np.percentile(a, [50, 90, 95, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(q[0]), "p90": float(q[1]),
            "p95": float(q[2]), "p99": float(q[3]), "max": float(a.max())}  # fmt: skip


def latency_stats(traces: list[Trace]) -> dict[str, Any]:
    """TTFT and ITL over every request that got tokens; TPOT and e2e over finished ones."""
    return {
        "ttft_ms": pcts([t.ttft_s for t in traces]),
        "itl_ms": pcts([x for t in traces for x in t.itl_samples()]),
        "tpot_ms": pcts([t.tpot_s for t in traces]),
        "e2e_ms": pcts([t.e2e_s for t in traces]),
        "delta_gap_ms": pcts([g for t in traces for g, _ in t.gaps()]),
    }


def load_stats(traces: list[Trace], t_start: float) -> dict[str, Any]:
    ends = [t.deltas[-1][0] for t in traces if t.deltas]
    span = (max(ends) - t_start) if ends else None
    out_tokens = sum(t.num_output for t in traces)
    finished = [t for t in traces if t.finish_reason in ("length", "stop")]
    return {
        "num_requests": len(traces),
        "num_finished": len(finished),
        "num_unfinished": sum(t.finish_reason is None and t.error is None for t in traces),
        "num_errors": sum(t.error is not None or t.finish_reason == "error" for t in traces),
        "finish_reasons": dict(Counter(str(t.finish_reason) for t in traces)),
        "output_tokens": out_tokens,
        "requested_output_tokens": sum(t.max_tokens for t in traces),
        "prompt_tokens": sum(t.prompt_len for t in traces),
        "span_s": span,
        "output_tok_s": out_tokens / span if span else None,
        "finished_req_s": len(finished) / span if span else None,
    }


QUANTILES = [1, 5, 10, 25, 50, 75, 90, 95, 99, 99.5, 99.9]


def itl_quantiles(traces: list[Trace]) -> dict[str, float] | None:
    a = np.asarray([x for t in traces for x in t.itl_samples()]) * 1e3
    if not a.size:
        return None
    return {str(q): float(v) for q, v in zip(QUANTILES, np.percentile(a, QUANTILES), strict=True)}
