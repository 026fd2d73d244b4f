"""The burst behind a TTFT p99, run against run (issue 14): what the engine saw of the burst's
arrivals and whether its prompt steps were fused, beside each run's TTFT p99.

    python bench/burst_windows.py RESULT.json ... [--rate 14] [--out BURST.json]

Each RESULT is a ``mixed.py --sweep --ttft-anatomy`` result (its ``.detail.json.gz`` beside it).
For every row at the rate, from its TTFT anatomy's ``window`` (``bench/ttft_anatomy.py``):

- ``max_queued_late_ms``: the longest an arrival waited for the engine to queue it (its engine
  stamp after the client's arrival; the event loop held by a launch delays it), over the
  window and its lead-in;
- ``steps``: each prompt step as (lane, tokens, the oldest queued prompt's wait the
  backlog-fuse rule read, the queued tokens it read); ``unfused_burst_steps``: prompt steps
  planned with at least ``--floor`` tokens queued that still ran beside the decode stream
  (the rule's wait, or a decode step in flight, said no);
- ``first_burst_wait_ms``: the oldest queued prompt's wait the rule read for the first of
  those steps (it fuses past ``fuse_decode_backlog_s``, 20 ms by default);
- ``loop_late``: the probe's late wake-ups (count, longest, sum), where the run had it.

The PNG beside the JSON plots each row's TTFT p99 against its ``first_burst_wait_ms``, the rows
with an unfused burst step marked apart.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import format_table, save_figure, write_json_and_plot  # noqa: E402
from result_files import load_result  # noqa: E402

FLOOR = 4096  # EngineConfig.fuse_decode_backlog_tokens' default
_QUEUED = re.compile(r"^([+-][0-9.]+) arrive (\S+) .*queued \+([0-9.]+) ms\)$")
_STEP = re.compile(r"^\S+ (\w+) (\d+) tok(?:.*\[wait ([0-9.]+) ms, queued (\d+) tok)?")
_LATE = re.compile(r" loop ([0-9.]+) ms late$")


def window_row(row: dict[str, Any], floor: int = FLOOR) -> dict[str, Any] | None:
    """One sweep row's burst (see the module docstring); None without a window."""
    win = (row.get("ttft_anatomy") or {}).get("window")
    if not win:
        return None
    late = [(m.group(2), float(m.group(3))) for m in map(_QUEUED.match, win["arrivals"]) if m]
    steps = []
    for line in win["prompt_steps"]:
        m = _STEP.match(line)
        if m:
            wait = None if m.group(3) is None else float(m.group(3))
            queued = None if m.group(4) is None else int(m.group(4))
            steps.append((m.group(1), int(m.group(2)), wait, queued))
    lates = [float(m.group(1)) for m in map(_LATE.search, win.get("loop_late") or []) if m]
    worst = max(late, key=lambda x: x[1]) if late else (None, None)
    return {
        "mode": row["mode"], "rate": row["rate"], "ttft_p99_ms": row["ttft_p99_ms"],
        "slowest": win["slowest"], "max_queued_late_ms": worst[1], "latest_queued": worst[0],
        "steps": steps, "fused_steps": sum(s[0] == "mixed" for s in steps),
        # None: the run logged no fuse reads (before 2bb3b22)
        "unfused_burst_steps": sum(s[0] == "prefill" and (s[3] or 0) >= floor for s in steps)
        if any(s[3] is not None for s in steps) else None,
        "first_burst_wait_ms": next((s[2] for s in steps if (s[3] or 0) >= floor), None),
        "loop_late": {"count": len(lates), "max_ms": max(lates, default=None),
                      "sum_ms": sum(lates)} if "loop_late" in win else None,
    }  # fmt: skip


def fuse_kind(row: dict[str, Any]) -> str:
    unfused = row["unfused_burst_steps"]
    return "not logged" if unfused is None else "unfused" if unfused else "fused"


def rows_of(paths: list[str], rate: float, floor: int = FLOOR) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        report = load_result(path)
        for row in report.get("sweep", []):
            if row.get("rate") != rate:
                continue
            found = window_row(row, floor)
            if found is not None:
                out.append({"file": Path(path).name, "git_commit": report.get("git_commit"),
                            **found})  # fmt: skip
    return out


def plot(result: dict[str, Any], path: Path) -> Path | None:
    rows = result["rows"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    kinds = (("fused", "o", "burst steps fused"), ("unfused", "x", "a burst step ran unfused"))
    for kind, style, label in kinds:
        pts = [(r["first_burst_wait_ms"], r["ttft_p99_ms"]) for r in rows
               if r["first_burst_wait_ms"] is not None and fuse_kind(r) == kind]  # fmt: skip
        if pts:
            ax.plot(*zip(*pts, strict=True), style, ms=8, label=label)
    ax.axvline(20.0, color="k", lw=0.8, ls=":", label="fuse_decode_backlog_s (20 ms)")
    ax.set_xlabel("the oldest queued prompt's wait, as the fuse rule read it (ms)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_title(f"the burst behind TTFT p99 at {rows[0]['rate']:g} req/s" if rows else "")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="mixed.py --ttft-anatomy result JSONs")
    p.add_argument("--rate", type=float, default=14.0)
    p.add_argument("--floor", type=int, default=FLOOR, help="queued tokens of a burst step")
    p.add_argument("--out", default=None, help="write the JSON here (and the PNG beside it)")
    args = p.parse_args(argv)
    rows = rows_of(args.results, args.rate, args.floor)
    result = {
        "command": " ".join(["python", "bench/burst_windows.py", *(argv or sys.argv[1:])]),
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "rate": args.rate, "floor": args.floor, "rows": rows,
    }  # fmt: skip
    head = ["file", "mode", "TTFT p99", "queued late", "burst wait", "fused", "unfused burst",
            "loop late max"]  # fmt: skip
    cells = [[r["file"].replace("mixed-", "").replace(".json", ""), r["mode"], r["ttft_p99_ms"],
              r["max_queued_late_ms"], r["first_burst_wait_ms"], r["fused_steps"],
              r["unfused_burst_steps"], (r["loop_late"] or {}).get("max_ms")]
             for r in rows]  # fmt: skip
    print(format_table(head, cells))
    write_json_and_plot(args.out, result, plot)
    return result


if __name__ == "__main__":
    main()
