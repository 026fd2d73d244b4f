"""Recent-window statistics behind the dashboard page (``GET /dashboard/data``).

Prometheus histograms are cumulative since start; the dashboard wants "now": percentiles over
the last ``horizon_s`` seconds of raw samples, plus the latest gauge values and running totals.
Everything here runs on the event-loop thread (the engine calls its observer from there).
"""

from __future__ import annotations

import time
from collections import Counter, deque

MAX_DRAFT_LEN = 16  # the histogram of chosen L covers 0..16


class Window:
    """Samples of the last ``horizon_s`` seconds (at most ``maxlen`` of them)."""

    def __init__(self, horizon_s: float = 30.0, maxlen: int = 4096) -> None:
        self.horizon_s = horizon_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, value: float) -> None:
        self._samples.append((time.monotonic(), value))

    def values(self) -> list[float]:
        cutoff = time.monotonic() - self.horizon_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        return [v for _, v in self._samples]


def percentiles(values: list[float], qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> dict:
    """Nearest-rank percentiles keyed "p50", "p95", ...; None when there are no samples."""
    if not values:
        return {f"p{round(q * 100)}": None for q in qs}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {f"p{round(q * 100)}": ordered[min(last, int(q * len(ordered)))] for q in qs}


class LiveStats:
    """Latest gauges, running totals and recent windows, fed by PrometheusObserver."""

    def __init__(self, horizon_s: float = 30.0) -> None:
        self.horizon_s = horizon_s
        self.lane_seconds: dict[str, Window] = {}
        self.lane_tokens: dict[str, Window] = {}
        self.lane_steps: Counter[str] = Counter()
        self.queue_depths: dict[str, int] = {}
        self.ttft, self.itl, self.e2e, self.queue = (Window(horizon_s) for _ in range(4))
        self.draft_lengths = Window(horizon_s)
        self.spec_drafted, self.spec_accepted = Window(horizon_s), Window(horizon_s)
        self.totals: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.num_running = self.num_waiting = 0
        self.kv_usage = 0.0
        self.kv_blocks_free: int | None = None
        self.drafter_temperature: float | None = None

    def lane_step(self, lane: str, seconds: float, num_tokens: int) -> None:
        if lane not in self.lane_seconds:
            self.lane_seconds[lane] = Window(self.horizon_s)
            self.lane_tokens[lane] = Window(self.horizon_s)
        self.lane_seconds[lane].add(seconds)
        self.lane_tokens[lane].add(num_tokens)
        self.lane_steps[lane] += 1

    def spec_tokens(self, num_drafted: int, num_accepted: int) -> None:
        self.spec_drafted.add(num_drafted)
        self.spec_accepted.add(num_accepted)
        self.totals["spec_drafted"] += num_drafted
        self.totals["spec_accepted"] += num_accepted

    def request_finished(self, reason: str, num_prompt: int, num_generated: int) -> None:
        self.finished[reason] += 1
        self.totals["prompt_tokens"] += num_prompt
        self.totals["generation_tokens"] += num_generated

    def snapshot(self) -> dict:
        """A JSON-ready view of the recent window and the current gauges."""
        return {
            "horizon_s": self.horizon_s,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_usage": self.kv_usage,
            "kv_blocks_free": self.kv_blocks_free,
            "drafter_temperature": self.drafter_temperature,
            "lanes": self._lanes_snapshot(),
            "ttft": percentiles(self.ttft.values()),
            "itl": percentiles(self.itl.values()),
            "e2e": percentiles(self.e2e.values()),
            "queue": percentiles(self.queue.values()),
            "draft_length_counts": self._draft_length_counts(),
            "acceptance_rate": self._acceptance_rate(),
            "acceptance_rate_total": _ratio(
                self.totals["spec_accepted"], self.totals["spec_drafted"]
            ),
            "totals": dict(self.totals),
            "finished": dict(self.finished),
        }

    def _lanes_snapshot(self) -> dict:
        lanes = sorted(set(self.lane_seconds) | set(self.queue_depths))
        return {lane: self._lane_snapshot(lane) for lane in lanes}

    def _lane_snapshot(self, lane: str) -> dict:
        seconds = self.lane_seconds[lane].values() if lane in self.lane_seconds else []
        tokens = self.lane_tokens[lane].values() if lane in self.lane_tokens else []
        step = percentiles(seconds, (0.5, 0.95))
        return {
            "queue_depth": self.queue_depths.get(lane, 0),
            "step_p50": step["p50"],
            "step_p95": step["p95"],
            "batch_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
            "steps_total": self.lane_steps[lane],
            "steps_per_s": len(seconds) / self.horizon_s,
        }

    def _draft_length_counts(self) -> list[int]:
        counts = [0] * (MAX_DRAFT_LEN + 1)
        for length in self.draft_lengths.values():
            counts[min(MAX_DRAFT_LEN, max(0, int(length)))] += 1
        return counts

    def _acceptance_rate(self) -> float | None:
        return _ratio(sum(self.spec_accepted.values()), sum(self.spec_drafted.values()))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None
