"""The rate sweep's plots (issue 14): p99 ITL, p99 TTFT and goodput against rate per acceptance
profile and temperature, one line per mode (``plot_rates``), and the policy's decisions over
time (``plot_timeline``), with the columnar form the timelines are stored in (``columnar``,
``timeline_samples``). ``sweep_report.py`` and ``mixed.py --sweep`` draw them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import save_figure

PANELS = (("itl_p99_ms", "ITL p99 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
          ("goodput_rps", "goodput req/s (SLO)"))  # fmt: skip
TIMELINE_KEYS = ("mean_draft_len", "fused_fraction", "lane")
TIMELINE_WORDS = ("fused", "lane", "draft_len")  # other snapshot keys of the policy's choices


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def panel_value(row: dict[str, Any], key: str) -> float | None:
    """A row's value for a panel: a column, or ``goodput@Y`` (its goodput at TPOT <= Y ms, from
    ``goodput_by_tpot_slo``)."""
    if key.startswith("goodput@"):
        return (row.get("goodput_by_tpot_slo") or {}).get(key.removeprefix("goodput@"))
    return row.get(key)


def plot_rates(
    stem: Path, rows: list[dict[str, Any]], tpot_slos: tuple[str, ...] = ()
) -> list[Path]:
    """One PNG per (profile, temperature): the PANELS against rate, one line per mode, and a
    panel of goodput at each TPOT target of ``tpot_slos`` (ms, as ``goodput_by_tpot_slo`` keys
    them: "4") with the plan's TTFT target."""
    plt = _plt()
    if plt is None:
        return []
    panels = PANELS + tuple((f"goodput@{y}", f"goodput req/s, TPOT <= {y} ms") for y in tpot_slos)
    paths = []
    keys = sorted({(r["acceptance_profile"], r["temperature"]) for r in rows})
    for profile, temp in keys:
        sel = [r for r in rows if (r["acceptance_profile"], r["temperature"]) == (profile, temp)]
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.3))
        for mode in dict.fromkeys(r["mode"] for r in sel):
            pts = sorted(((r["rate"], r) for r in sel if r["mode"] == mode), key=lambda p: p[0])
            for ax, (key, _) in zip(axes, panels, strict=True):
                xy = [(x, v) for x, r in pts if (v := panel_value(r, key)) is not None]
                if xy:
                    ax.plot(*zip(*xy, strict=True), marker="o", label=mode)
        for ax, (_, title) in zip(axes, panels, strict=True):
            ax.set(xlabel="arrival rate req/s", title=f"{title}: {profile}, T={temp}")
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = stem.with_name(f"{stem.stem}-{profile}-t{temp}.png")
        save_figure(fig, path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def columnar(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's policy snapshots as stored: ``columns`` (every key, in first-seen order) and
    ``values`` (one list per snapshot; None where a snapshot lacks the key). The keys repeated
    in every snapshot were two thirds of a sweep's JSON (the results folder's timelines went
    from 25.8 to 7.7 MB)."""
    columns = list(dict.fromkeys(k for s in samples for k in s))
    return {"columns": columns, "values": [[s.get(k) for k in columns] for s in samples]}


def timeline_samples(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``policy_timeline`` entry's snapshots as dicts, from either form: ``columnar``, or
    the ``samples`` list of dicts of files written before 2026-11-26 (a None value reads as
    an absent key, as the plots treat it)."""
    if "samples" in entry:
        return entry["samples"]
    columns = entry.get("columns", [])
    return [{k: v for k, v in zip(columns, row, strict=True) if v is not None}
            for row in entry.get("values", [])]  # fmt: skip


def plot_timeline(path: Path, timeline: list[dict[str, Any]]) -> Path | None:
    """The policy's decisions over time (snapshot keys in TIMELINE_KEYS that it has), one
    panel per key, one line per (rate, profile, temperature)."""
    plt = _plt()
    timeline = [{**t, "samples": timeline_samples(t)} for t in timeline]
    keys = dict.fromkeys(k for t in timeline for s in t["samples"] for k in s)
    present = [k for k in keys if k in TIMELINE_KEYS or any(w in k for w in TIMELINE_WORDS)]
    if plt is None or not present:
        return None
    fig, axes = plt.subplots(len(present), 1, figsize=(11, 3.2 * len(present)), squeeze=False)
    for ax, key in zip(axes[:, 0], present, strict=True):
        for t in timeline:
            xy = [(s["t_s"], s[key]) for s in t["samples"] if s.get(key) is not None]
            if xy:
                label = f"{t['acceptance_profile']} T={t['temperature']} {t['rate']}/s"
                ax.plot(*zip(*xy, strict=True), label=label, lw=0.8)
        ax.set(xlabel="s since the run's start", ylabel=key, title=f"policy: {key} over time")
        ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


def plot_all(png: Path, rows: list[dict[str, Any]], timeline: list[dict[str, Any]]):
    """Every sweep plot next to ``png``'s stem; returns the first (for the run's summary)."""
    paths = plot_rates(png, rows)
    line = plot_timeline(png.with_name(f"{png.stem}-policy.png"), timeline)
    paths += [line] if line else []
    for p in paths:
        print(f"plot {p}")
    return paths[0] if paths else None
