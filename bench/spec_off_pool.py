"""Zero cost off over several sittings (issue 14): the runs of several ``bench/spec_off_cost.py``
files pooled per server, with a bootstrap interval on each ratio the issue names.

One ABBA sitting compares the mean of two runs a server. The same server's throughput moves by
±3 % from run to run on the H200 and its TTFT p99 by up to 1.8× (the opening wave of 24 prompts
decides it), so one sitting's verdict is often the noise's. Pooled, each ratio is
mean(drafter runs) / mean(no-drafter runs); its interval comes from drawing each server's runs
again with replacement. A target is *met* when the whole interval is on its good side, *missed*
when the whole interval is past it, and *not settled* otherwise (the point estimate's side is
given too).

    python bench/spec_off_pool.py A.json B.json ... [--out POOL.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import format_table, save_figure, write_json_and_plot  # noqa: E402
from spec_off_cost import TARGETS  # noqa: E402

# metric of a run -> (its target in spec_off_cost.TARGETS, allowed relative loss, higher is better)
CHECKS = {
    "output_tok_s": ("throughput", TARGETS["throughput"], True),
    "ttft_p99_ms": ("ttft_p99", TARGETS["ttft_p99"], False),
    "itl_p99_ms": ("itl_p99", TARGETS["itl_p99"], False),
}
SHOWN = ("output_tok_s", "ttft_p99_ms", "ttft_first_wave_p99_ms", "ttft_later_p99_ms",
         "itl_p50_ms", "itl_p99_ms")  # fmt: skip
SERVERS = ("no-drafter", "drafter")
RESAMPLES = 4000
LEVEL = 0.95


def runs_of(result: dict[str, Any], metric: str) -> dict[str, list[float]]:
    """Each server's per-run values of ``metric`` in one spec_off_cost result."""
    out: dict[str, list[float]] = {s: [] for s in SERVERS}
    for run in result["runs"]:
        value = run.get(metric)
        if run["server"] in out and value is not None:
            out[run["server"]].append(float(value))
    return out


def ratio_interval(base: list[float], other: list[float], seed: int = 0) -> list[float] | None:
    """[low, high] of mean(other) / mean(base) with each side's runs drawn again with
    replacement; None unless both sides have two runs or more."""
    if len(base) < 2 or len(other) < 2:
        return None
    rng = np.random.default_rng(seed)
    a = np.asarray(base)[rng.integers(0, len(base), size=(RESAMPLES, len(base)))].mean(axis=1)
    b = np.asarray(other)[rng.integers(0, len(other), size=(RESAMPLES, len(other)))].mean(axis=1)
    tail = (1.0 - LEVEL) / 2.0
    low, high = np.quantile(b / a, [tail, 1.0 - tail])
    return [float(low), float(high)]


def verdict(ratio: float, interval: list[float] | None, tol: float, higher_better: bool) -> str:
    """met / missed / not settled (ratio on the good or bad side), as the module says."""
    good = (lambda r: r >= 1 - tol) if higher_better else (lambda r: r <= 1 + tol)
    if interval is not None and good(interval[0]) and good(interval[1]):
        return "met"
    if interval is not None and not good(interval[0]) and not good(interval[1]):
        return "missed"
    side = "met" if good(ratio) else "missed"
    return f"not settled (point {side})" if interval is not None else f"{side} (one run a side)"


def pool(results: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per metric: each server's runs over every result, the pooled ratio and its interval,
    each sitting's own ratio, and for the three targets the verdict."""
    out = {}
    for metric in SHOWN:
        per = [runs_of(r, metric) for r in results]
        base = [v for p in per for v in p["no-drafter"]]
        other = [v for p in per for v in p["drafter"]]
        if not base or not other:
            continue
        ratio = float(np.mean(other) / np.mean(base))
        cell = {
            "no_drafter_runs": base, "drafter_runs": other, "ratio": ratio,
            "interval": ratio_interval(base, other, seed),
            "sitting_ratios": [float(np.mean(p["drafter"]) / np.mean(p["no-drafter"]))
                               if p["drafter"] and p["no-drafter"] else None for p in per],
        }  # fmt: skip
        if metric in CHECKS:
            name, tol, higher = CHECKS[metric]
            cell.update(target=name, allowed_loss=tol)
            cell["verdict"] = verdict(ratio, cell["interval"], tol, higher)
        out[metric] = cell
    return out


def lines(result: dict[str, Any]) -> list[str]:
    rows = []
    for metric, c in result["pooled"].items():
        iv = c["interval"]
        rows.append([metric, len(c["no_drafter_runs"]), len(c["drafter_runs"]),
                     round(c["ratio"], 3), "-" if iv is None else f"{iv[0]:.3f}-{iv[1]:.3f}",
                     " ".join(f"{r:.3f}" for r in c["sitting_ratios"] if r is not None),
                     c.get("verdict", "")])  # fmt: skip
    headers = ["metric", "runs A", "runs B", "B / A", f"{LEVEL:.0%} interval", "sittings",
               "verdict"]  # fmt: skip
    return [format_table(headers, rows)]


def plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics = [m for m in CHECKS if m in result["pooled"]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6))
    for ax, m in zip(np.atleast_1d(axes), metrics, strict=True):
        c = result["pooled"][m]
        sittings = [r for r in c["sitting_ratios"] if r is not None]
        ax.plot(range(len(sittings)), sittings, "o", label="one sitting (ABBA)")
        x = len(sittings) + 0.5
        iv = c["interval"] or [c["ratio"], c["ratio"]]
        ax.errorbar([x], [c["ratio"]], yerr=[[c["ratio"] - iv[0]], [iv[1] - c["ratio"]]],
                    fmt="s", color="k", capsize=4, label="pooled, 95 % interval")  # fmt: skip
        higher = CHECKS[m][2]
        ax.axhline(1 - c["allowed_loss"] if higher else 1 + c["allowed_loss"], color="r",
                   ls="--", lw=0.9, label="target")  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(f"{m.replace('_ms', '')}: drafter / none\n{c['verdict']}", fontsize=9)
        ax.set_xticks([])
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench/spec_off_cost.py JSONs")
    p.add_argument("--out", default=None, help="write the JSON here (and the PNG beside it)")
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.results]
    result = {
        "command": " ".join(["python", "bench/spec_off_pool.py", *(argv or sys.argv[1:])]),
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "devices": sorted({str(r.get("device")) for r in results}),
        "git_commits": [r.get("git_commit") for r in results],
        "sittings": [{"file": f, "git_commit": r.get("git_commit"), "params": r.get("params")}
                     for f, r in zip(args.results, results, strict=True)],
        "resamples": RESAMPLES, "level": LEVEL, "pooled": pool(results),
    }  # fmt: skip
    print("\n".join(lines(result)))
    write_json_and_plot(args.out, result, plot)
    return result


if __name__ == "__main__":
    main()
