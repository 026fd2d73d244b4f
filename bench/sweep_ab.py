"""Two code versions on one sweep plan (``sweep_report.py NEW.json --ab OLD.json``): per metric,
the new / old ratio in every (profile, temperature, rate, mode) cell both runs have, how many
cells moved beyond the tolerance either way, and, where both rows carry bootstrap intervals
(bench/intervals.py), how many of those moves are clear of them. Lower is better for every
metric here but goodput."""

from __future__ import annotations

from typing import Any

import numpy as np

AB_METRICS = ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms", "tpot_p50_ms", "goodput_rps")
HIGHER_BETTER = ("goodput_rps",)


def _key(r: dict[str, Any]) -> tuple:
    return (r["acceptance_profile"], r["temperature"], r["rate"], r["mode"])


def _clear(new: dict[str, Any], old: dict[str, Any], metric: str) -> bool | None:
    """The two rows' intervals of ``metric`` do not meet (None: a row has none)."""
    key = metric.replace("_p99_ms", "_p99_ci_ms")
    if key == metric:
        return None
    a, b = new.get(key), old.get(key)
    if not a or not b:
        return None
    return a[0] > b[1] or b[0] > a[1]


def ab_compare(
    new_rows: list[dict[str, Any]], old_rows: list[dict[str, Any]], tol: float = 0.05
) -> dict[str, Any]:
    """Per metric: each shared cell's ratio (new / old), and the counts of cells ``better`` and
    ``worse`` by more than ``tol`` (and of those, ``clear`` ones where intervals exist)."""
    old = {_key(r): r for r in old_rows}
    out: dict[str, Any] = {"tolerance": tol}
    for metric in AB_METRICS:
        cells = []
        for r in new_rows:
            o = old.get(_key(r))
            a, b = (o or {}).get(metric), r.get(metric)
            if not a or b is None:
                continue
            ratio = b / a
            gain = ratio - 1.0 if metric in HIGHER_BETTER else 1.0 - ratio
            cells.append({"acceptance_profile": r["acceptance_profile"],
                          "temperature": r["temperature"], "rate": r["rate"], "mode": r["mode"],
                          "new": b, "old": a, "ratio": ratio,
                          "moved": "better" if gain > tol else "worse" if gain < -tol else "level",
                          "clear": _clear(r, o, metric)})  # fmt: skip
        if not cells:
            continue
        summary: dict[str, Any] = {
            "cells": len(cells),
            "median_ratio": float(np.median([c["ratio"] for c in cells])),
        }
        for way in ("better", "worse"):
            moved = [c for c in cells if c["moved"] == way]
            summary[way] = len(moved)
            if any(c["clear"] is not None for c in moved):
                summary[f"{way}_clear"] = sum(c["clear"] is True for c in moved)
        out[metric] = {**summary, "by_cell": cells}
    return out


def ab_lines(ab: dict[str, Any], new: str, old: str) -> list[str]:
    """One line per metric: median ratio, cells better / worse beyond the tolerance."""
    tol = ab["tolerance"]
    lines = [f"{new} against {old} (new / old; cells beyond {tol:.0%}):"]
    for metric in AB_METRICS:
        m = ab.get(metric)
        if m:
            better, worse = (f"{m[w]}" + _clear_note(m, w) for w in ("better", "worse"))
            lines.append(f"  {metric}: median {m['median_ratio']:.3f}, better in {better},"
                         f" worse in {worse} of {m['cells']}")  # fmt: skip
    return lines


def _clear_note(m: dict[str, Any], way: str) -> str:
    return f" ({m[way + '_clear']} clear)" if way + "_clear" in m else ""
