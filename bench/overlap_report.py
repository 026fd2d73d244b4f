"""``bench/overlap.py``'s summary of its samples: medians per kind, the gains of overlapping
the lanes, the table and the figure, and the premise DESIGN.md measured (a stand-in MLP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from common import bar_panels, median


def _median_of(samples: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in samples if key in s]
    return median(values) if values else None


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per kind over the samples whose gate held (all of them in real timing)."""
    by_kind = {k: [s for s in v if s["gate_held"]] for k, v in samples.items()}

    def med(kind: str, key: str) -> float | None:
        return _median_of(by_kind.get(kind, []), key)

    out: dict[str, Any] = {
        "decode_alone_ms": med("alone", "decode_ms"),
        "decode_overlap_ms": med("overlap", "decode_ms"),
        "decode_fused_ms": med("fused", "decode_ms"),
        "decode_sequential_ms": med("sequential", "decode_ms"),
        "verify_alone_ms": med("verify", "verify_ms"),
        "verify_overlap_ms": med("overlap", "verify_ms"),
        "overlap_total_ms": med("overlap", "total_ms"),
        "sequential_total_ms": med("sequential", "total_ms"),
        "gpu_overlap_ms": med("overlap", "overlap_ms"),
        "verify_busy_at_arrival_frac": float(
            np.mean([s["verify_busy_at_arrival"] for s in by_kind.get("overlap", [])] or [0.0])
        ),
        "host_launch_ms": {
            "decode": med("alone", "d_host_ms"),
            "verify": med("verify", "v_host_ms"),
            "fused": med("fused", "d_host_ms"),
        },
        "gate_not_held": sum(not s["gate_held"] for v in samples.values() for s in v),
    }
    out |= gains(out)
    out["samples"] = samples
    return out


def gains(m: dict[str, Any]) -> dict[str, float | None]:
    """Relative decode-latency gain of overlapping lanes (1 - overlap / other)."""
    ov = m["decode_overlap_ms"]

    def gain(other: float | None) -> float | None:
        return None if not ov or not other else 1.0 - ov / other

    va, vo = m["verify_alone_ms"], m["verify_overlap_ms"]
    verify_cost = vo / va - 1 if va and vo is not None else None
    return {
        "gain_vs_fused": gain(m["decode_fused_ms"]),
        "gain_vs_sequential": gain(m["decode_sequential_ms"]),
        "verify_slowdown": verify_cost,
    }


# ----------------------------------------------------------------------------- report
HEADERS = ["timing", "batch", "alone ms", "w/ verify ms", "fused ms", "seq ms", "gain/fused",
           "gain/seq", "verify ms", "verify w/ dec", "busy frac"]  # fmt: skip


def summary_rows(results: dict[str, Any], timings: list[str]) -> list[list[Any]]:
    rows = []
    for timing in timings:
        for b, r in results.items():
            m = r.get(timing)
            if m is None:
                rows.append([timing, b, *["-"] * 8, r.get("error", "failed")[:40]])
                continue
            rows.append([
                timing, b, m["decode_alone_ms"], m["decode_overlap_ms"], m["decode_fused_ms"],
                m["decode_sequential_ms"], _pct(m["gain_vs_fused"]), _pct(m["gain_vs_sequential"]),
                m["verify_alone_ms"], m["verify_overlap_ms"], m["verify_busy_at_arrival_frac"],
            ])  # fmt: skip
    return rows


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:+.1f}%"


def plot(path: Path, results: dict[str, Any], timings: list[str]) -> Path | None:
    labels = [f"B={b}" for b in results]
    keys = {"alone": "decode_alone_ms", "verify in flight": "decode_overlap_ms",
            "fused": "decode_fused_ms", "sequential": "decode_sequential_ms"}  # fmt: skip
    panels = []
    for timing in timings:
        series = {n: [r.get(timing, {}).get(k) for r in results.values()] for n, k in keys.items()}
        panels.append((f"{timing}: decode step latency (median)", "ms", labels, series))
    return bar_panels(path, panels)


def progress_view(r: dict[str, Any], timings: list[str]) -> dict[str, Any]:
    view: dict[str, Any] = {}
    for t in timings:
        m = r.get(t) or {}
        view |= {f"{t}_{k}": m.get(f"decode_{k}_ms") for k in ("alone", "overlap", "fused")}
    return view


METHOD = (
    "decode latency = decode arrival -> end of its step, CUDA events (arrival marked on an idle "
    "stream); nothing folded back, so every repetition runs the same positions; gain = 1 - "
    "overlap / other; verify_busy_at_arrival_frac = share of overlap samples where verify was "
    "still running when decode arrived; medians over --repeats (see the module docstring)"
)
# DESIGN.md's measured premise (H200, 7B-like bf16 MLP chain standing in for the model), ms.
DESIGN_PREMISE = {
    "1": {"decode_overlap_ms": 4.1, "decode_fused_ms": 3.4},
    "32": {"decode_overlap_ms": 5.5, "decode_fused_ms": 6.8, "decode_sequential_ms": 7.8},
    "64": {"decode_overlap_ms": 6.1, "decode_fused_ms": 7.2, "decode_sequential_ms": 10.1},
    "decode_alone_ms": 3.5,
}
