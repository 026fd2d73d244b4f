"""How far a sweep row's p99s could move on another trace of the same load: bootstrap intervals
of the TTFT, ITL and TPOT p99, resampling whole requests (a request's inter-token gaps move
together: they share its prompt, its neighbours and its acceptance), and whether a criterion's
miss is clear of them.

A p99 over 14 requests (2 req/s for 8 s) is decided by a handful of tokens; the same commit's
8-second sweep points moved by more than 5 % between calls in a quarter to a third of cases. An
interval says which differences a run can tell apart. Seeded: the same traces give the same
intervals. The p99 inside the bootstrap is nearest-rank over the resampled tokens (weights are
request counts), so its interval may sit a little off the row's interpolated p99."""

from __future__ import annotations

from typing import Any

import numpy as np

RESAMPLES = 200
LEVEL = 0.95
SEED = 0
METRICS = ("ttft", "itl", "tpot")


def _per_request(traces: list, metric: str) -> list[np.ndarray]:
    """Each request's samples of ``metric`` in ms (ITL: one per token; TTFT, TPOT: one)."""
    out = []
    for t in traces:
        if metric == "itl":
            samples = list(t.itl_samples())
        else:
            v = getattr(t, f"{metric}_s")
            samples = [] if v is None else [v]
        if samples:
            out.append(np.asarray(samples, dtype=np.float64) * 1e3)
    return out


def _weighted_q(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Nearest-rank quantile of ``values`` (sorted) with integer ``weights``."""
    cum = np.cumsum(weights)
    return float(values[np.searchsorted(cum, q * cum[-1])])


def p99_interval(
    groups: list[np.ndarray], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> list[float] | None:
    """[low, high] of the p99 over ``groups`` (one array per request) when requests are drawn
    again with replacement, ``resamples`` times; None with fewer than two requests."""
    if len(groups) < 2:
        return None
    values = np.concatenate(groups)
    owner = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(groups), size=(resamples, len(groups)))
    stats = [_weighted_q(values, np.bincount(d, minlength=len(groups))[owner], 0.99) for d in draws]
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return [float(low), float(high)]


def row_intervals(traces: list, **kwargs: Any) -> dict[str, list[float] | None]:
    """``{ttft,itl,tpot}_p99_ci_ms`` of one sweep row."""
    return {f"{m}_p99_ci_ms": p99_interval(_per_request(traces, m), **kwargs) for m in METRICS}


def clear_miss(mine: dict[str, Any], best: dict[str, Any], metric: str, tol: float) -> bool | None:
    """For a lower-is-better p99 ``metric`` (``itl_p99_ms``, ...): even the low end of ``mine``'s
    interval is above (1 + ``tol``) times the high end of ``best``'s (the two runs' intervals
    do not meet within the tolerance): a miss no rerun of this load is likely to turn. None
    where a row has no interval (older results, too few requests)."""
    key = metric.replace("_p99_ms", "_p99_ci_ms")
    a, b = mine.get(key), best.get(key)
    if not a or not b:
        return None
    return a[0] > (1.0 + tol) * b[1]
