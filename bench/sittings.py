"""The policy against vLLM over several sittings (issue 14): one sitting's "ahead at every rate"
moves with the machine and the run, vLLM's p99s more than ours, so this puts the sittings side
by side.

    python bench/sittings.py REPORT[:VARIANT] ... [--profile hetero] [--temperature 0] \
        [--out SITTINGS.json]

Each REPORT is a ``sweep_report.py`` JSON with a vLLM comparison. Without VARIANT the
in-process check (``policy_ahead_of_vllm``) is read; with one, the check of that ``policy-NAME``
mode or HTTP label (``variants_ahead_of_vllm`` / ``http_variants_ahead_of_vllm``; ``http`` is the
plain ``policy-http`` rows). Per rate and p99 it gives the policy / vLLM ratio in every sitting,
their median and range, and how many sittings were ahead, clearly ahead and clearly behind (the
two rows' bootstrap intervals apart); per sitting, the rates ahead on all three p99s. The PNG
beside the JSON draws the ratios against rate, one panel per p99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import format_table, save_figure, write_json_and_plot  # noqa: E402

METRICS = ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms")
VARIANT_KEYS = ("variants_ahead_of_vllm", "http_variants_ahead_of_vllm")


def checks_of(report: dict[str, Any], variant: str | None) -> list[dict[str, Any]]:
    """The report's per-rate checks against vLLM for ``variant`` (see the module docstring)."""
    crit = report.get("criteria") or {}
    if variant is None:
        found = crit.get("policy_ahead_of_vllm")
    elif variant == "http":
        found = crit.get("http_policy_ahead_of_vllm")
    else:
        found = next((crit[k][variant] for k in VARIANT_KEYS if variant in (crit.get(k) or {})),
                     None)  # fmt: skip
    if not found or not found.get("checks"):
        raise SystemExit(f"no vLLM checks for {variant or 'the policy'} in this report")
    return found["checks"]


def sitting(path: str, report: dict[str, Any], variant: str | None, profile: str,
            temperature: float) -> dict[str, Any]:  # fmt: skip
    rows = [c for c in checks_of(report, variant)
            if c["acceptance_profile"] == profile and c["temperature"] == temperature]  # fmt: skip
    if not rows:
        raise SystemExit(f"{path}: no check for {profile} at T={temperature}")
    return {
        "file": Path(path).name, "variant": variant, "git_commit": report.get("git_commit"),
        "device": report.get("device"),
        "rates_ahead": [c["rate"] for c in rows if c["ok"]],
        "num_rates": len(rows),
        "cells": {c["rate"]: {m: c[m] for m in METRICS} for c in rows},
    }  # fmt: skip


def combine(sittings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rate, p99): every sitting's policy / vLLM ratio and the counts."""
    rates = sorted({r for s in sittings for r in s["cells"]})
    out = []
    for rate in rates:
        for m in METRICS:
            cells = [s["cells"][rate][m] for s in sittings if rate in s["cells"]]
            ratios = [c["policy"] / c["vllm"] for c in cells]
            out.append({
                "rate": rate, "metric": m, "num_sittings": len(cells),
                "ratios": [round(x, 4) for x in ratios],
                "ratio_median": round(statistics.median(ratios), 4),
                "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
                "num_ahead": sum(c["policy"] <= c["vllm"] for c in cells),
                "num_clearly_ahead": sum(c["clear"] and c["policy"] < c["vllm"] for c in cells),
                "num_clearly_behind": sum(c["clear"] and c["policy"] > c["vllm"] for c in cells),
            })  # fmt: skip
    return out


def plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(METRICS), figsize=(13, 3.8), sharey=True)
    for ax, m in zip(axes, METRICS, strict=True):
        for s in result["sittings"]:
            rates = sorted(s["cells"])
            ratio = [s["cells"][r][m]["policy"] / s["cells"][r][m]["vllm"] for r in rates]
            name = Path(s["file"]).stem.replace("sweep-report-", "")
            ax.plot(
                rates,
                ratio,
                "o-",
                alpha=0.6,
                label=name + (f" {s['variant']}" if s["variant"] else ""),
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{m.replace('_ms', '')}: policy / vLLM")
        ax.set_xlabel("req/s")
    axes[0].set_ylabel("ratio (below 1: policy ahead)")
    axes[-1].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def lines(result: dict[str, Any]) -> list[str]:
    head = ["rate", "p99", "sittings", "ahead", "clearly ahead", "clearly behind", "median",
            "range"]  # fmt: skip
    cells = [[c["rate"], c["metric"].replace("_p99_ms", ""), c["num_sittings"], c["num_ahead"],
              c["num_clearly_ahead"], c["num_clearly_behind"], f"{c['ratio_median']:.3f}",
              f"{c['ratio_min']:.2f}-{c['ratio_max']:.2f}"] for c in result["cells"]]  # fmt: skip
    per = ", ".join(f"{s['file']} {len(s['rates_ahead'])}/{s['num_rates']}"
                    for s in result["sittings"])  # fmt: skip
    return [format_table(head, cells), f"rates ahead on all three p99s: {per}"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="REPORT.json[:VARIANT]")
    p.add_argument("--profile", default="hetero")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default=None, help="write the JSON here (and the PNG beside it)")
    args = p.parse_args(argv)
    sittings = []
    for spec in args.reports:
        path, _, variant = spec.partition(".json:")
        path = path if path.endswith(".json") else path + ".json"
        report = json.loads(Path(path).read_text())
        sittings.append(sitting(path, report, variant or None, args.profile, args.temperature))
    result = {
        "command": " ".join(["python", "bench/sittings.py", *(argv or sys.argv[1:])]),
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "devices": sorted({str(s["device"]) for s in sittings}),
        "git_commits": [s["git_commit"] for s in sittings],
        "profile": args.profile, "temperature": args.temperature,
        "sittings": sittings, "cells": combine(sittings),
    }  # fmt: skip
    print("\n".join(lines(result)))
    write_json_and_plot(args.out, result, plot)
    return result


if __name__ == "__main__":
    main()
