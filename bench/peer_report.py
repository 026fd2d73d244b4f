"""``peer_vllm.py combine``: the step files of both engines joined into one report, one row per
comparison with verifypd's advantage (``ratio_rows``), its table and its bar chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import format_table, save_figure


def combine(args) -> dict[str, Any]:
    parts: dict[str, dict[str, Any]] = {"verifypd": {}, "vllm": {}}
    http: dict[str, Any] = {}
    sources, meta = [], None
    for f in args.files:
        data = json.loads(Path(f).read_text())
        m = data["meta"]
        sources.append({"file": Path(f).name, "git_commit": m["git_commit"],
                        "date_utc": m["date_utc"], "device": m["device"]})  # fmt: skip
        meta = meta or data["meta"]
        if data["step"] == "http":
            http[data["engine"]] = data["result"]
        else:
            parts[data["engine"]].update(data["result"])
    rows = ratio_rows(parts, http)
    return {"meta": meta, "sources": sources, "verifypd": parts["verifypd"],
            "vllm": parts["vllm"], "http": http, "table": rows}  # fmt: skip


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and k < len(d):
            d = d[k]
        else:
            return None
    return d


def _decode(res: dict, part: str, batch: int) -> float | None:
    for row in _get(res, part, "decode") or []:
        if row.get("batch") == batch:
            return row["decode_tok_s"]
    return None


def ratio_rows(ours: dict, theirs: dict) -> list[dict[str, Any]]:
    """One row per comparison: (what, unit, verifypd, vLLM, verifypd / vLLM, higher_is_better)."""
    rows = []

    def add(what, unit, a, b, higher=True):
        ratio = (a / b if higher else b / a) if a and b else None
        rows.append({"what": what, "unit": unit, "verifypd": a, "vllm": b,
                     "advantage": ratio, "higher_is_better": higher})  # fmt: skip

    for part in ("decode", "spec-draft", "spec-ngram"):
        for b in (1, 64):
            add(f"{part} batch {b}", "tok/s", _decode(ours.get("verifypd", {}), part, b),
                _decode(ours.get("vllm", {}), part, b))  # fmt: skip
    off_ours = max(
        (_get(ours, "verifypd", "offline", f, "output_tok_s") or 0) for f in ("async", "llm")
    )
    add(
        "offline 256 req",
        "out tok/s",
        off_ours or None,
        _get(ours, "vllm", "offline", "async", "output_tok_s"),
    )
    for label, a_rates, b_rates in (
        (
            "in-process",
            _get(ours, "verifypd", "mixed", "rates"),
            _get(ours, "vllm", "mixed", "rates"),
        ),
        ("http", _get(theirs, "verifypd", "rates"), _get(theirs, "vllm", "rates")),
    ):
        for i, row in enumerate(a_rates or []):
            other = _get(b_rates, i)
            for key in ("ttft_ms", "itl_ms", "tpot_ms"):
                for q in ("p50", "p99"):
                    what = f"mixed {label} {row['rate']:g} req/s {key[:-3]} {q}"
                    add(what, "ms", _get(row, "latency", key, q), _get(other, "latency", key, q),
                        higher=False)  # fmt: skip
            add(f"mixed {label} {row['rate']:g} req/s goodput", "req/s", row.get("goodput_rps"),
                _get(other, "goodput_rps"))  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    body = [
        [r["what"], r["unit"], r["verifypd"], r["vllm"],
         None if r["advantage"] is None else f"{r['advantage']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    return format_table(["what", "unit", "verifypd", "vLLM", "verifypd advantage"], body)


def plot(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    good = [r for r in rows if r["advantage"]]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(good) + 1.5))
    ax.barh([r["what"] for r in good], [r["advantage"] for r in good],
            color=["tab:green" if r["advantage"] >= 1 else "tab:red" for r in good])  # fmt: skip
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("verifypd advantage over vLLM (>1: verifypd better)")
    ax.invert_yaxis()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
