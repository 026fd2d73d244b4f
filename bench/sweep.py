"""The rate sweep of issue 14, engine-agnostic: the plan (rates, acceptance profiles,
temperatures, the seeded traces), one run of a trace through any ``generate(request_id,
prompt_ids, params)`` front (``AsyncEngine``, ``http_load.HttpEngine``, vLLM's ``AsyncLLM``
behind ``peer_vllm.VllmFront``) and the summary row of a run; the criteria over the rows are
bench/sweep_criteria.py.

A trace depends on (seed, rate) only: every mode, profile and temperature at one rate replays
the same prompts at the same arrival times. A profile's per-request alphas are drawn from
(seed, rate, profile), so they too are identical in every mode (and every engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from intervals import row_intervals
from loadgen import Mix, Request, latency_stats, load_stats, make_requests, run_load

from verifypd.types import SamplingParams

# Acceptance profiles: (alpha, share of requests).
PROFILES: dict[str, tuple[tuple[float, float], ...]] = {
    "uniform-0.8": ((0.8, 1.0),),
    "uniform-0.6": ((0.6, 1.0),),
    "hetero": ((0.9, 0.3), (0.6, 0.4), (0.2, 0.3)),
}
LATENCY_KEYS = ("ttft", "itl", "tpot", "e2e")
PERCENTILES = ("p50", "p95", "p99")


@dataclass(frozen=True)
class SweepPlan:
    mix: Mix
    vocab: int  # prompt ids are below it
    seed: int
    rates: tuple[float, ...]
    profiles: tuple[str, ...]
    temperatures: tuple[float, ...]
    num_requests: int  # per run, at most
    run_seconds: float  # arrivals stop after this (0 = off)
    drain_timeout: float  # s after the last arrival; then unfinished requests are aborted
    slo_ttft_ms: float
    slo_tpot_ms: float
    # Before the measured runs, the sweep's throwaway engine (in-process; ``mixed.py
    # --throwaway-engine``), or the HTTP server or vLLM replaying the plan, serves this many
    # seconds of another trace at the first rate, unrecorded.
    burn_in_s: float = 0.0
    id_prefix: str = "req"  # request ids (the burn-in's: "burn")

    def __post_init__(self) -> None:
        unknown = set(self.profiles) - set(PROFILES)
        if unknown:
            raise ValueError(f"unknown acceptance profiles {sorted(unknown)}: {list(PROFILES)}")

    def requests(self, rate: float) -> list[Request]:
        return make_requests(self.mix, self.vocab, self.rate_seed(rate), self.num_requests, rate,
                             self.run_seconds, prefix=self.id_prefix)  # fmt: skip

    def rate_seed(self, rate: float) -> int:
        return self.seed * 7919 + int(round(rate * 1000))

    def alphas(self, rate: float, profile: str, count: int) -> list[float]:
        values, shares = zip(*PROFILES[profile], strict=True)
        rng = np.random.default_rng([self.rate_seed(rate), zlib.crc32(profile.encode())])
        return [float(values[i]) for i in rng.choice(len(values), size=count, p=shares)]

    def runs(self) -> list[tuple[float, str, float]]:
        """(rate, profile, temperature) in the order each engine runs them."""
        return [(r, p, t) for r in self.rates for p in self.profiles for t in self.temperatures]

    def burn_in(self) -> SweepPlan | None:
        """The burn-in's plan: another seed's trace at the first rate, ``burn_in_s`` long;
        None without one."""
        if self.burn_in_s <= 0.0:
            return None
        return dataclasses.replace(
            self, seed=self.seed + 1, rates=self.rates[:1], run_seconds=self.burn_in_s,
            burn_in_s=0.0, id_prefix="burn",
        )  # fmt: skip

    def run_estimate_s(self, rate: float) -> float:
        """Arrivals (the shorter of the count and the time bound) plus a few seconds of drain."""
        span = self.num_requests / rate
        return (min(span, self.run_seconds) if self.run_seconds else span) + 4.0

    def estimate_s(
        self, num_engines: int, build_s: float = 60.0, warmup_s: float = 15.0,
        with_burn_in: bool = True,
    ):  # fmt: skip
        """Builds, warm-ups and runs of ``num_engines``, and the burn-in once where it is served
        (``with_burn_in``)."""
        per_engine = build_s + warmup_s + sum(self.run_estimate_s(r) for r, _, _ in self.runs())
        burn = self.burn_in() if with_burn_in else None
        return num_engines * per_engine + (burn.run_estimate_s(burn.rates[0]) if burn else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepPlan:
        d = dict(d)
        d["mix"] = Mix(*(tuple(v) if isinstance(v, list) else v for v in d["mix"].values()))
        for key in ("rates", "profiles", "temperatures"):
            d[key] = tuple(d[key])
        return cls(**d)


# ----------------------------------------------------------------------------- one run
def request_params(
    plan: SweepPlan, req: Request, index: int, temperature: float, alpha: float | None
) -> SamplingParams:
    """Seeded per request (the synthetic draws and sampled tokens repeat in every mode)."""
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=temperature,
        seed=plan.seed * 1_000_003 + index,
        ignore_eos=True,
        synthetic_acceptance=alpha,
    )


def trace_fingerprint(submitted: list[tuple[str, float, list[int], int, float]]) -> str:
    """sha256 of what was submitted: (id, arrival s, prompt, max_tokens, the trace's alpha)."""
    text = json.dumps([[rid, round(t, 9), p, n, a] for rid, t, p, n, a in submitted])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_trace(plan: SweepPlan, rate: float, profile: str):
    """(requests, their alphas, the fingerprint) of the (rate, profile) trace."""
    reqs = plan.requests(rate)
    alphas = plan.alphas(rate, profile, len(reqs))
    submitted = [(r.request_id, r.arrival_s, r.prompt, r.max_tokens, a)
                 for r, a in zip(reqs, alphas, strict=True)]  # fmt: skip
    return reqs, alphas, trace_fingerprint(submitted)


async def burn_in(engine: Any, plan: SweepPlan, send_alpha: bool) -> None:
    """Serves the plan's burn-in trace (``SweepPlan.burn_in``) on ``engine``, unrecorded."""
    burn = plan.burn_in()
    if burn is not None:
        await run_trace(engine, burn, burn.rates[0], burn.profiles[0], burn.temperatures[0],
                        send_alpha)  # fmt: skip


def plan_fingerprint(plan: SweepPlan, rate: float, profile: str) -> str:
    return plan_trace(plan, rate, profile)[2]


async def _sample(snapshot: Callable[[], Any], out: list, t0: float, every: float):
    while True:
        snap = await _take(snapshot)
        out.append({"t_s": time.perf_counter() - t0, **_scalars(snap)})
        await asyncio.sleep(every)


async def _take(snapshot: Callable[[], Any]) -> dict[str, Any]:
    """``snapshot()``, awaited where it is a coroutine (a ``RemoteEngine``'s, asked of the
    engine process)."""
    snap = snapshot()
    return await snap if inspect.isawaitable(snap) else snap


def _scalars(snap: dict[str, Any]) -> dict[str, Any]:
    ok = (int, float, str, bool, type(None))
    return {k: v for k, v in snap.items() if isinstance(v, ok)}


async def run_trace(
    engine: Any,
    plan: SweepPlan,
    rate: float,
    profile: str,
    temperature: float,
    send_alpha: bool,
    snapshot: Callable[[], Any] | None = None,
    snapshot_every: float = 0.25,
) -> dict[str, Any]:
    """Replays the (rate, profile) trace at ``temperature``; per request its profile alpha goes
    out as ``synthetic_acceptance`` when ``send_alpha`` (engines in synthetic mode). Returns the
    traces, the start time, the fingerprint of the submitted trace and the sampled snapshots
    (``snapshot``: a function or a coroutine function, every ``snapshot_every`` seconds)."""
    reqs, alphas, fingerprint = plan_trace(plan, rate, profile)

    def params_of(i: int, req: Request) -> SamplingParams:
        return request_params(plan, req, i, temperature, alphas[i] if send_alpha else None)

    samples: list[dict[str, Any]] = []
    task = None
    t0 = time.perf_counter()
    if snapshot is not None:
        task = asyncio.create_task(_sample(snapshot, samples, t0, snapshot_every))
    try:
        traces, t_start = await run_load(engine, reqs, params_of, plan.drain_timeout)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if snapshot is not None:  # the run's end state last (the sampler sleeps between samples)
        samples.append({"t_s": time.perf_counter() - t0, **_scalars(await _take(snapshot))})
    return {"traces": traces, "t_start": t_start, "samples": samples,
            "fingerprint": fingerprint, "alphas": alphas,
            "alpha_of": {r.request_id: a for r, a in zip(reqs, alphas, strict=True)}}  # fmt: skip


# ----------------------------------------------------------------------------- one row
# TPOT targets (ms) the goodput is also given at, with the plan's TTFT target: where between a
# lax SLO (every mode meets it below saturation) and one tighter than a plain step speculation
# starts to decide which requests meet it.
TPOT_SLO_LADDER_MS = (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0)


def goodput(
    traces: list, span_s: float | None, plan: SweepPlan, tpot_ms: float | None = None
) -> tuple[float | None, int]:
    """DistServe's goodput: finished requests/s meeting TTFT <= X and TPOT <= Y (a one-token
    output has no TPOT and meets that half); Y is the plan's unless ``tpot_ms`` is given."""
    y = plan.slo_tpot_ms if tpot_ms is None else tpot_ms
    met = [t for t in traces if t.finish_reason in ("length", "stop") and t.ttft_s is not None
           and t.ttft_s * 1e3 <= plan.slo_ttft_ms
           and (t.tpot_s is None or t.tpot_s * 1e3 <= y)]  # fmt: skip
    return (len(met) / span_s if span_s else None), len(met)


def summary_row(
    result: dict[str, Any], plan: SweepPlan, rate: float, profile: str, temperature: float,
    mode: str, **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    traces = result["traces"]
    lat, load = latency_stats(traces), load_stats(traces, result["t_start"])
    row: dict[str, Any] = {"rate": rate, "acceptance_profile": profile,
                           "temperature": temperature, "mode": mode}  # fmt: skip
    for key in LATENCY_KEYS:
        for p in PERCENTILES:
            row[f"{key}_{p}_ms"] = lat[f"{key}_ms"][p]
    row |= row_intervals(traces)  # the p99s' bootstrap intervals (bench/intervals.py)
    good, num_met = goodput(traces, load["span_s"], plan)
    n = load["num_requests"]
    row |= {
        "goodput_rps": good,
        "slo_attainment": num_met / n if n else None,
        "goodput_by_tpot_slo": {
            f"{y:g}": goodput(traces, load["span_s"], plan, y)[0] for y in TPOT_SLO_LADDER_MS
        },
        "output_tok_s": load["output_tok_s"],
        "num_requests": n,
        "num_finished": load["num_finished"],
        "num_unfinished": load["num_unfinished"],
        "num_errors": load["num_errors"],
        "span_s": load["span_s"],
        "trace_fingerprint": result["fingerprint"],
        "mean_alpha": float(np.mean(result["alphas"])) if result["alphas"] else None,
        "slowest": slowest_requests(traces, result.get("alpha_of", {}), result["t_start"]),
        "tpot_by_alpha": tpot_by_alpha(traces, result.get("alpha_of", {})),
        **extra,
    }
    return row


def tpot_by_alpha(traces: list, alpha_of: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per acceptance class of the profile (its α, as "0.9"), the finished requests with a TPOT
    and their TPOT p50 / p99 (ms). The light-load target is on the median request, which for
    hetero is an α ≈ 0.6 one: this says how far each class is from ``off``'s."""
    groups: dict[str, list[float]] = {}
    for t in traces:
        alpha = alpha_of.get(t.request_id)
        if alpha is not None and t.tpot_s is not None and t.finish_reason in ("length", "stop"):
            groups.setdefault(f"{alpha:g}", []).append(t.tpot_s * 1e3)
    return {
        key: {
            "num": len(v),
            "tpot_p50_ms": float(np.percentile(v, 50)),
            "tpot_p99_ms": float(np.percentile(v, 99)),
        }
        for key, v in sorted(groups.items(), key=lambda kv: -float(kv[0]))
    }


SLOWEST_SHARE = 0.05  # the p99's company: the slowest 5 % of requests (at least 3)


def slowest_requests(
    traces: list, alpha_of: dict[str, float], t_start: float | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Per metric (TTFT, TPOT), the slowest requests, slowest first: who they were (kind,
    prompt and output length, the profile's α for them) and their TTFT, TPOT and longest gap
    between deltas. What a p99 is made of (is the policy's TPOT tail its low-α requests, or
    long prompts' neighbours?). The TPOT ones also carry every delta (``deltas_ms``: ms since
    the request's arrival, tokens) and, given the run's start, ``arrival_ms`` from it: two
    engines' runs of one trace compared token by token (``bench/tpot_pairs.py``)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for metric in ("ttft", "tpot"):
        timed = [t for t in traces if getattr(t, f"{metric}_s") is not None]
        timed.sort(key=lambda t: getattr(t, f"{metric}_s"), reverse=True)
        timed = timed[: max(3, math.ceil(SLOWEST_SHARE * len(timed)))]
        out[metric] = [_request_summary(t.row(), alpha_of.get(t.request_id)) for t in timed]
    for entry, t in zip(out["tpot"], timed, strict=True):
        entry["deltas_ms"] = [[round((d - t.arrival) * 1e3, 3), k] for d, k in t.deltas]
        if t_start is not None:
            entry["arrival_ms"] = round((t.arrival - t_start) * 1e3, 3)
    return out


def _request_summary(row: dict[str, Any], alpha: float | None) -> dict[str, Any]:
    ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
    return {"request_id": row["request_id"], "kind": row["kind"],
            "prompt_len": row["prompt_len"], "num_output": row["num_output"], "alpha": alpha,
            "ttft_ms": ms(row["ttft_s"]), "tpot_ms": ms(row["tpot_s"]),
            "max_gap_ms": ms(row["max_gap_s"])}  # fmt: skip
