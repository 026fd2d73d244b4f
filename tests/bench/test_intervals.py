"""bench/intervals.py: bootstrap intervals of a sweep row's p99s (requests resampled whole) and
whether a criterion's miss is clear of them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import load_bench


@pytest.fixture(scope="module")
def iv():
    return load_bench("intervals")


def _trace(itl_s: list[float], ttft_s: float | None = 0.05, tpot_s: float | None = 0.01):
    return SimpleNamespace(itl_samples=lambda: list(itl_s), ttft_s=ttft_s, tpot_s=tpot_s)


def test_the_weighted_quantile_is_the_nearest_rank_one_of_the_expanded_sample(iv) -> None:
    rng = np.random.default_rng(1)
    values = np.sort(rng.exponential(5.0, 300))
    weights = rng.integers(0, 4, 300)
    weights[0] = 1  # at least one token
    expanded = np.repeat(values, weights)
    for q in (0.5, 0.9, 0.99):
        want = np.quantile(expanded, q, method="inverted_cdf")
        assert iv._weighted_q(values, weights, q) == pytest.approx(want)


def test_the_interval_holds_the_p99_and_narrows_with_more_requests(iv) -> None:
    rng = np.random.default_rng(2)

    def groups(n):
        return [rng.gamma(4.0, 1.0, 150) for _ in range(n)]

    few, many = groups(12), groups(400)
    lo_f, hi_f = iv.p99_interval(few)
    lo_m, hi_m = iv.p99_interval(many)
    assert lo_m <= np.percentile(np.concatenate(many), 99) <= hi_m
    assert lo_f <= np.percentile(np.concatenate(few), 99) <= hi_f
    assert (hi_m - lo_m) < 0.5 * (hi_f - lo_f)
    assert iv.p99_interval(few) == [lo_f, hi_f]  # seeded
    assert iv.p99_interval(few[:1]) is None and iv.p99_interval([]) is None


def test_requests_are_resampled_whole(iv) -> None:
    """The same tokens, once spread over every request and once all slow ones in two requests:
    only the second interval reaches from the fast tokens to the slow ones (whether the p99
    lands on them depends on whether those requests were drawn)."""
    fast = [np.full(98, 4.0) for _ in range(20)]
    spread = [np.append(g, [30.0, 30.0]) for g in fast]  # 2 % slow in every request
    clustered = [np.append(g, [4.0, 4.0]) for g in fast]
    clustered[0][:20] = 30.0  # the same 2 %, in two requests
    clustered[1][:20] = 30.0
    assert iv.p99_interval(spread) == [30.0, 30.0]
    lo, hi = iv.p99_interval(clustered)
    assert lo == 4.0 and hi == 30.0


def test_row_intervals_read_each_metric(iv) -> None:
    traces = [_trace([0.004] * 50 + [0.02], ttft_s=0.01 * (i + 1)) for i in range(10)]
    traces.append(_trace([], ttft_s=None, tpot_s=None))  # no token: left out
    out = iv.row_intervals(traces)
    assert set(out) == {"ttft_p99_ci_ms", "itl_p99_ci_ms", "tpot_p99_ci_ms"}
    assert out["tpot_p99_ci_ms"] == pytest.approx([10.0, 10.0])
    lo, hi = out["ttft_p99_ci_ms"]
    assert 10.0 <= lo <= hi <= 100.0
    assert iv.row_intervals(traces[:1]) == dict.fromkeys(out)


def test_a_clear_miss_needs_intervals_apart_beyond_the_tolerance(iv) -> None:
    mine = {"itl_p99_ci_ms": [11.0, 12.0]}
    assert iv.clear_miss(mine, {"itl_p99_ci_ms": [9.0, 10.0]}, "itl_p99_ms", 0.05) is True
    assert iv.clear_miss(mine, {"itl_p99_ci_ms": [9.0, 10.6]}, "itl_p99_ms", 0.05) is False
    assert iv.clear_miss(mine, {}, "itl_p99_ms", 0.05) is None
    assert iv.clear_miss({"itl_p99_ci_ms": None}, mine, "itl_p99_ms", 0.05) is None


def test_the_criteria_count_the_clear_misses() -> None:
    sweep = load_bench("sweep_criteria")

    def row(mode, itl, ci):
        return {"mode": mode, "rate": 2, "acceptance_profile": "hetero", "temperature": 0.0,
                "ttft_p99_ms": 100.0, "itl_p99_ms": itl, "tpot_p99_ms": 10.0,
                "goodput_rps": 5.0, "tpot_p50_ms": 8.0, "itl_p99_ci_ms": ci}  # fmt: skip

    rows = [row("off", 10.0, [9.5, 10.5]), row("policy", 12.0, [11.5, 12.5])]
    within = sweep.criteria(rows)["policy_within_5pct_of_best"]
    (miss,) = [c for c in within["checks"] if not c["ok"]]
    assert miss["clear_miss"] is True
    assert (within["num_clear_misses"], within["num_misses_weighed"]) == (1, 1)
    assert "1 of 1 misses clear" in sweep.criteria_lines({"w": within})[0]
    rows[1]["itl_p99_ci_ms"] = [10.0, 14.0]  # the same miss, inside the noise
    within = sweep.criteria(rows)["policy_within_5pct_of_best"]
    assert within["verdict"] == "MISS" and within["num_clear_misses"] == 0
