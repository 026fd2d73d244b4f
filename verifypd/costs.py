"""Step costs measured on the hardware at start-up (``engine.calibrate``): the speculation
policy's prior on what a target forward, a prefill chunk and a drafter step take.

Plain data and interpolation, no torch, so the controller can use it without the engine.

Keys of ``CostTable.target``: (rows, query_len), one forward of ``rows`` sequences that each
feed ``query_len`` tokens over a context of ``context_len`` tokens (q = 1 is a decode step,
q = 1 + L a verify of L drafts), through the path a step takes (a CUDA-graph replay where one
was captured). ``query_len`` 0 means an *eager mixed* step: ``rows // 2`` decode rows (1 token)
and the other rows verifying ``mixed_draft_len`` drafts each, the non-uniform shape of a decode
step with a verify fused into it, which no graph covers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

MIXED = 0  # the query_len key of eager mixed shapes


def piecewise_linear(
    points: list[tuple[float, float]], x: float, xs: list[float] | None = None
) -> float | None:
    """y at ``x`` on the polyline through ``points`` (sorted by x, distinct x), extended
    linearly by its end segments; None without points. One point: y scales with x. Below the
    first point the result never falls under y scaling with x (a cost does not drop faster
    than its work), and never below 0. ``xs``: the points' x values, when the caller keeps them."""
    if not points:
        return None
    x0, y0 = points[0]
    if len(points) == 1:
        return y0 * x / x0
    xs = xs if xs is not None else [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (xa, ya), (xb, yb) = points[i - 1], points[i]
    y = ya + (yb - ya) * (x - xa) / (xb - xa)
    if x < x0:
        y = max(y, y0 * x / x0)
    return max(y, 0.0)


@dataclass(frozen=True)
class CostTable:
    """Seconds per forward, measured (see the module docstring for the keys)."""

    target: dict[tuple[int, int], float]  # (rows, query_len) -> seconds of one target forward
    prefill: dict[int, float]  # tokens -> seconds of one prefill-chunk forward (one sequence)
    draft: dict[int, float]  # rows -> seconds of one drafter single-token step ({} without one)
    context_len: int = 0  # context tokens of every measured decode/verify/draft row
    mixed_draft_len: int = 0  # drafts of the verify rows of the eager mixed shapes
    meta: dict[str, Any] = field(default_factory=dict)  # how it was measured (to_dict only)

    def target_time(self, rows: int, query_len: int) -> float | None:
        """One target forward of ``rows`` rows of ``query_len`` tokens: linear in rows between
        the measured points of one query length. An unmeasured ``query_len`` takes the nearest
        measured one above it unscaled (a forward of fewer tokens per row costs no more: an
        upper bound) or, past the largest, the largest scaled by tokens (q / q_max).
        ``query_len`` 0 (eager mixed) uses only its own points. None when nothing applies."""
        if query_len == MIXED:
            return self._at(MIXED, rows)
        measured = self._curves["measured"]
        if not measured:
            return None
        i = bisect.bisect_left(measured, query_len)
        above = i < len(measured)
        q = measured[i] if above else measured[-1]
        t = self._at(q, rows)
        return t if above or t is None else t * query_len / q

    def prefill_time(self, tokens: int) -> float | None:
        """One prefill chunk of ``tokens`` tokens, piecewise linear, extrapolated linearly."""
        points, xs = self._curves["prefill"]
        return piecewise_linear(points, tokens, xs)

    def draft_time(self, rows: int) -> float | None:
        """One drafter single-token step of ``rows`` rows (linear in rows between points)."""
        points, xs = self._curves["draft"]
        return piecewise_linear(points, rows, xs)

    def _at(self, query_len: int, rows: int) -> float | None:
        points, xs = self._curves.get(query_len, ([], []))
        return piecewise_linear(points, rows, xs)

    @cached_property
    def _curves(self) -> dict:
        """The tables as sorted polylines, built once (the policy reads them a dozen times
        before every decode step): per query length ``(points, xs)``, the measured query
        lengths (``"measured"``), and ``"prefill"`` / ``"draft"`` as ``(points, xs)``."""

        def line(items) -> tuple[list[tuple[float, float]], list[float]]:
            points = sorted(items)
            return points, [p[0] for p in points]

        curves: dict = {
            q: line((r, t) for (r, qq), t in self.target.items() if qq == q)
            for q in {q for _, q in self.target}
        }
        curves["measured"] = sorted({q for _, q in self.target if q != MIXED})
        curves["prefill"] = line(self.prefill.items())
        curves["draft"] = line(self.draft.items())
        return curves

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (metrics, benchmark reports): lists of points, seconds."""
        return {
            "context_len": self.context_len,
            "mixed_draft_len": self.mixed_draft_len,
            "target": [
                {"rows": r, "query_len": q, "seconds": t}
                for (r, q), t in sorted(self.target.items())
            ],
            "prefill": [{"tokens": n, "seconds": t} for n, t in sorted(self.prefill.items())],
            "draft": [{"rows": r, "seconds": t} for r, t in sorted(self.draft.items())],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        return cls(
            target={(p["rows"], p["query_len"]): p["seconds"] for p in data["target"]},
            prefill={p["tokens"]: p["seconds"] for p in data["prefill"]},
            draft={p["rows"]: p["seconds"] for p in data["draft"]},
            context_len=data.get("context_len", 0),
            mixed_draft_len=data.get("mixed_draft_len", 0),
            meta=dict(data.get("meta", {})),
        )

    def summary(self) -> str:
        """One line for the start-up log: each curve's smallest and largest point, in ms."""
        parts = []
        for q in sorted({q for _, q in self.target}):
            name = "mixed" if q == MIXED else ("decode" if q == 1 else f"q={q}")
            parts.append(f"{name} {_ends(self._curves[q][0], 'rows')}")
        if self.prefill:
            parts.append(f"prefill {_ends(sorted(self.prefill.items()), 'tok')}")
        if self.draft:
            parts.append(f"draft {_ends(sorted(self.draft.items()), 'rows')}")
        return f"step costs (context {self.context_len}): " + "; ".join(parts)


def _ends(points: list[tuple[float, float]], unit: str) -> str:
    (x0, y0), (x1, y1) = points[0], points[-1]
    if len(points) == 1:
        return f"{x0:g} {unit} {y0 * 1e3:.2f} ms"
    return f"{x0:g}-{x1:g} {unit} {y0 * 1e3:.2f}-{y1 * 1e3:.2f} ms"
