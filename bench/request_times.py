"""Where each request's first token spent its time through a front (issue 14's HTTP TTFT gap).

``mixed.py --sweep`` keeps, per row of a sweep through a front (``--http``, ``--engine-process``),
every request's client-side stamps in the row's details (``request_times``): its intended
arrival, when the client called ``generate`` and when the first delta came, as
``time.perf_counter()`` readings, which on Linux are ``CLOCK_MONOTONIC`` as ``time.monotonic()``
is, so they line up with the server's and the engine's stamps on the same host. Through
``--engine-process`` the rows also hold the ``RemoteEngine``'s own stamps (handed to the
engine, sent by the engine process, got by the front); over HTTP the server logs its own with
``verifypd serve --log-request-timing`` (serve/request_timing.py), matched here by the
``X-Request-Id`` the client sends.

    python bench/request_times.py RESULT.json [--server-log LOG[.gz]] [--rate 14] [--top 8] \
        [--out SPLIT.json]

prints, for the slowest first tokens of each row, the split (ms) of the client's TTFT:

- ``late``: the client's call after the intended arrival;
- ``to_front``: the call to the HTTP handler's start;
- ``parse``: the handler (without HTTP: the client's call) to the engine's arrival stamp;
- ``engine``: the engine's queue, prompt steps and first token, to the engine process's send
  (with the engine in the front's process: to the front's get);
- ``pipe``: the engine process's send to the front's get;
- ``write``: the front's get to the chunk's write;
- ``to_client``: to the client's read.

A part the path lacks is blank.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
from common import format_table, save_figure, write_json_and_plot  # noqa: E402
from result_files import load_result  # noqa: E402

TIMING_MARK = "request timing "  # serve/request_timing.py's log line
PARTS = ("late", "to_front", "parse", "engine", "pipe", "write", "to_client")


# ----------------------------------------------------------------------------- recording
def client_times(traces: list, t_start: float, id_prefix: str = "") -> dict[str, Any]:
    """A row's ``request_times``: columns per request (perf_counter seconds, absolute)."""
    return {
        "id_prefix": id_prefix,
        "t_start": t_start,
        "request_id": [t.request_id for t in traces],
        "prompt_len": [t.prompt_len for t in traces],
        "arrival": [t.arrival for t in traces],
        "sent": [t.sent for t in traces],
        "first": [t.deltas[0][0] if t.deltas else None for t in traces],
    }


def with_engine_times(times: dict[str, Any], timings: dict[str, Any]) -> dict[str, Any]:
    """``times`` plus the ``RequestTiming`` stamps a ``RemoteEngine`` filled per request id."""
    for name in ("arrival", "engine_first", "first_out"):
        times[f"engine_{name}"] = [
            getattr(timings.get(rid), name, None) for rid in times["request_id"]
        ]
    return times


# ----------------------------------------------------------------------------- reading
def server_lines(path: Path) -> dict[str, dict[str, Any]]:
    """The server's timing lines by the client's ``X-Request-Id``."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = {}
    with opener(path, "rt", errors="replace") as f:
        for line in f:
            at = line.find(TIMING_MARK)
            if at >= 0:
                record = json.loads(line[at + len(TIMING_MARK) :])
                if record.get("client_id"):
                    out[record["client_id"]] = record
    return out


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1e3, 2)


def splits(times: dict[str, Any], server: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per request: its TTFT and the parts of it (ms), slowest first."""
    rows = []
    for i, rid in enumerate(times["request_id"]):
        arrival, sent, first = times["arrival"][i], times["sent"][i], times["first"][i]
        if first is None:
            continue
        row = {"request_id": rid, "prompt_len": times["prompt_len"][i],
               "at_s": round(arrival - times["t_start"], 3), "ttft": _ms(arrival, first),
               "late": _ms(arrival, sent)}  # fmt: skip
        stamps = _path_stamps(times, i, server.get(times.get("id_prefix", "") + rid))
        received, handed, engine_first, got, written = stamps
        row |= {  # the parts add up to the TTFT where the path has every stamp
            "to_front": _ms(sent, received), "parse": _ms(received or sent, handed),
            "engine": _ms(handed, engine_first or got), "pipe": _ms(engine_first, got),
            "write": _ms(got, written), "to_client": _ms(written or got, first),
        }  # fmt: skip
        rows.append(row)
    return sorted(rows, key=lambda r: -r["ttft"])


def _path_stamps(
    times: dict[str, Any], i: int, line: dict[str, Any] | None
) -> tuple[float | None, ...]:
    """(received, handed to the engine, engine sent, front got, written) in seconds."""
    if line is not None:  # over HTTP: the server's line, in ms after its own ``received``
        base = line["received"]

        def at(name: str) -> float | None:
            ms = line.get(f"{name}_ms")
            return None if ms is None else base + ms / 1e3

        return base, at("arrival"), at("engine_first"), at("first_out"), at("first_sent")
    if "engine_arrival" in times:  # --engine-process: the RemoteEngine's, no HTTP
        col = {k: times[f"engine_{k}"][i] for k in ("arrival", "engine_first", "first_out")}
        return None, col["arrival"], col["engine_first"], col["first_out"], None
    return None, None, None, None, None


def summarize(result: dict[str, Any], server: dict, rate: float | None, top: int) -> list[dict]:
    """Per row with ``request_times``: each part's median and p90 over its first tokens, and
    the ``top`` slowest with their parts."""
    out = []
    for row in result["sweep"]:
        times = row.get("request_times")
        if times is None or (rate is not None and row["rate"] != rate):
            continue
        ranked = splits(times, server)
        stats = {}
        for part in ("ttft", *PARTS):
            values = [r[part] for r in ranked if r[part] is not None]
            if values:
                p50, p90 = np.percentile(values, [50, 90])
                stats[part] = {"p50": round(float(p50), 2), "p90": round(float(p90), 2)}
        out.append({k: row[k] for k in ("mode", "acceptance_profile", "temperature", "rate")}
                   | {"num_first_tokens": len(ranked), "parts": stats,
                      "slowest": ranked[:top]})  # fmt: skip
    return out


def report(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        lines.append(f"{row['mode']} {row['acceptance_profile']} T={row['temperature']} "
                     f"{row['rate']}/s: {row['num_first_tokens']} first tokens; p50 / p90 of "
                     "each part over all, then the slowest")  # fmt: skip
        parts = row["parts"]
        lines.append("  " + ", ".join(f"{k} {v['p50']} / {v['p90']}" for k, v in parts.items()))
        headers = ["request", "prompt", "at s", "TTFT", *PARTS]
        cells = [
            [r["request_id"], r["prompt_len"], r["at_s"], r["ttft"], *[_blank(r[p]) for p in PARTS]]
            for r in row["slowest"]
        ]
        lines += [format_table(headers, cells), ""]
    return lines


def _blank(value: float | None) -> Any:
    return "" if value is None else value


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """One panel per row: the slowest first tokens as stacked bars of their parts."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.2 + 0.35 * max(
        (len(r["slowest"]) for r in rows), default=1) * len(rows)), squeeze=False)  # fmt: skip
    for ax, row in zip(axes[:, 0], rows, strict=True):
        names = [f"{r['request_id']} ({r['prompt_len']})" for r in row["slowest"]][::-1]
        left = np.zeros(len(names))
        for part in PARTS:
            widths = np.array([r[part] or 0.0 for r in row["slowest"]][::-1])
            ax.barh(names, widths, left=left, label=part)
            left += widths
        ax.set_title(f"{row['mode']} {row['acceptance_profile']} {row['rate']}/s", fontsize=9)
        ax.set_xlabel("ms after the intended arrival")
    axes[0, 0].legend(fontsize=7, ncol=len(PARTS), loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path, 110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a mixed.py --sweep JSON through a front")
    p.add_argument("--server-log", default=None, help="verifypd serve --log-request-timing log")
    p.add_argument("--rate", type=float, default=None, help="only this rate")
    p.add_argument("--top", type=int, default=8, help="slowest first tokens shown per row")
    p.add_argument("--out", default=None, help="the split as JSON (and a PNG beside it)")
    args = p.parse_args(argv)
    server = server_lines(Path(args.server_log)) if args.server_log else {}
    rows = summarize(load_result(Path(args.result)), server, args.rate, args.top)
    print("\n".join(report(rows)) if rows else "no row with request_times")
    command = "python bench/request_times.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_json_and_plot(args.out, {"command": command, "rows": rows}, plot)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
