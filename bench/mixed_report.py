"""What one mode's run of ``mixed.py`` (not ``--sweep``) records and reports: the step recorder
with the draft lengths handed out and the slowest proposals (``LoadRecorder``), the controller's
time means, a mode's results, and the table and plot of every mode side by side.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from common import draw_bars, save_figure
from harness import StepRecorder, keep_slowest
from loadgen import itl_quantiles, latency_stats, load_stats


class LoadRecorder(StepRecorder):
    """``StepRecorder`` plus the histogram of draft lengths handed out per sequence and step."""

    def reset(self) -> None:
        super().reset()
        self.draft_lens: Counter[int] = Counter()
        self.slowest_proposals: list[tuple[float, int, float]] = []  # (s, seqs, t_end)

    def time_proposals(self, policy) -> None:
        """Wraps ``policy.propose`` (``SpeculationPolicy``; it runs on the event loop, outside
        every lane step) to keep the slowest calls: the event loop waits while a proposal is
        enqueued (its drafting runs on the GPU after it returns), and so does every lane's next
        launch."""
        inner = policy.propose

        def timed(entries, *args, **kwargs):
            t = time.perf_counter()
            out = inner(entries, *args, **kwargs)
            end = time.perf_counter()
            keep_slowest(self.slowest_proposals, (end - t, len(entries), end - self.t0))
            return out

        policy.propose = timed

    def draft_length(self, draft_len: int) -> None:
        self.draft_lens[draft_len] += 1

    def spec_summary(self) -> dict[str, Any]:
        n = sum(self.draft_lens.values())
        mean_l = sum(k * v for k, v in self.draft_lens.items()) / n if n else None
        return {
            "draft_len_hist": {str(k): v for k, v in sorted(self.draft_lens.items())},
            "mean_draft_len_decided": mean_l,
            "mean_drafts_per_verify": self.num_drafted / self.num_spec_calls
            if self.num_spec_calls
            else None,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else None,
            "slowest_proposals": [
                {"seconds": s, "num_seqs": n, "t_end_s": t} for s, n, t in self.slowest_proposals
            ],
        }


def controller_stats(snaps: list[dict[str, Any]], final: dict[str, Any]) -> dict[str, Any]:
    def mean(key: str) -> float | None:
        vals = [s[key] for s in snaps if s.get(key) is not None]
        return float(np.mean(vals)) if vals else None

    keys = ("mean_draft_len", "mean_acceptance", "p95_decode_s", "verify_queue_depth")
    return {
        "num_snapshots": len(snaps),
        "time_mean": {k: mean(k) for k in keys},
        "pressure_frac": float(np.mean([s["pressure"] is not None for s in snaps]))
        if snaps
        else None,
        "final": final,
    }


def mode_results(llm, recorder: LoadRecorder, traces, snaps, t_start) -> dict[str, Any]:
    core = llm.core
    spec_on = core.spec.enabled
    return {
        "load": load_stats(traces, t_start),
        "latency": latency_stats(traces),
        "by_kind": {
            k: latency_stats([t for t in traces if t.kind == k]) for k in ("short", "long")
        },
        "itl_quantiles_ms": itl_quantiles(traces),
        "steps": recorder.summary(),
        "spec": recorder.spec_summary() if spec_on else None,
        "controller": controller_stats(snaps, core.controller.snapshot()) if spec_on else None,
        "requests": [t.row() for t in traces],
        "_itl": [x for t in traces for x in t.itl_samples()],  # for the plot, not the JSON
    }


# ----------------------------------------------------------------------------- report
HEADERS = ["mode", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99", "TPOT p99", "out tok/s",
           "mean L", "accept", "done", "note"]  # fmt: skip


def summary_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, r in results.items():
        if "latency" not in r:
            rows.append([name, *["-"] * 11, r.get("error", "failed")[:40]])
            continue
        lat, load = r["latency"], r["load"]
        ttft, itl = lat["ttft_ms"], lat["itl_ms"]
        spec = r["spec"] or {}
        rows.append([
            name, ttft["p50"], ttft["p95"], ttft["p99"], itl["p50"], itl["p95"], itl["p99"],
            lat["tpot_ms"]["p99"], load["output_tok_s"], spec.get("mean_drafts_per_verify"),
            spec.get("acceptance_rate"), f"{load['num_finished']}/{load['num_requests']}",
            "synthetic acceptance" if r["speculate"] else "no speculation",
        ])  # fmt: skip
    return rows


def plot(path: Path, results: dict[str, Any], itl: dict[str, list[float]]) -> Path | None:
    """ITL CDF per mode, and p50/p95/p99 bars of ITL and TTFT."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = {n: r for n, r in results.items() if "latency" in r}
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.8))
    for name, samples in itl.items():
        if samples:
            x = np.sort(np.asarray(samples) * 1e3)
            axes[0].plot(x, np.arange(1, x.size + 1) / x.size, label=name)
    axes[0].set(xscale="log", xlabel="ITL ms (log)", ylabel="fraction of tokens",
                title="ITL CDF (synthetic acceptance)")  # fmt: skip
    axes[0].legend(fontsize=8)
    labels = list(ok)
    for ax, key, title in ((axes[1], "itl_ms", "ITL"), (axes[2], "ttft_ms", "TTFT")):
        series = {p: [ok[n]["latency"][key][p] for n in labels] for p in ("p50", "p95", "p99")}
        draw_bars(ax, f"{title} percentiles per mode", "ms", labels, series)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def progress_view(r: dict[str, Any]) -> dict[str, Any]:
    lat = r.get("latency") or {}
    return {
        "ttft_p99_ms": (lat.get("ttft_ms") or {}).get("p99"),
        "itl_p99_ms": (lat.get("itl_ms") or {}).get("p99"),
        "output_tok_s": (r.get("load") or {}).get("output_tok_s"),
        "error": r.get("error"),
    }
