"""Where a peer's TPOT tail beats ours, request by request (issue 14 diagnostics).

Two runs of one trace (ours from ``mixed.py --sweep [--itl-anatomy]``, the peer's from
``peer_vllm.py sweep [--trace-steps]``) hold the same slowest-TPOT requests with every delta
(``slowest.tpot[].deltas_ms``, bench/sweep.py). For each request in both lists this lines the
two runs up token by token: token ``j``'s lag is the time ours delivered it minus the time the
peer did (both from the request's arrival). Over each of our gaps the lag grows by our gap minus
the peer's time for the same tokens, and the growth is credited to the kind of step that ended
our gap (from the ITL anatomy's ``tpot_tail``: its lane, and whether a prompt step ran beside
it) and to the gap's size. That says where the lag moved, not why: a gap picked for being long on
our side grows the lag almost by construction (the peer's burst came at another moment), and a
steady one shrinks it. The fair comparison is each engine's own time in gaps of each size over
the same requests (``gaps_by_size``: steady < 10 ms a token, slowed < 25, stall beyond), which
says whether ours loses on the bursts or on the steps between them.

    python bench/tpot_pairs.py OURS.json PEER.json --rate 20 [--mode policy] [--out X.json]

Per request it also lists the largest lag growths with the peer's engine steps over the same
tokens, where the peer's run logged them (``engine_steps``).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import format_table, write_json  # noqa: E402
from result_files import load_result  # noqa: E402

# Per-token gap sizes (ms): a steady decode step, a slowed one, a stall (a prompt's compute).
SIZE_BOUNDS_MS = ((10.0, "steady"), (25.0, "slowed"), (float("inf"), "stall"))


def size_class(gap_ms: float, tokens: int) -> str:
    per_token = gap_ms / max(tokens, 1)
    return next(name for bound, name in SIZE_BOUNDS_MS if per_token < bound)


def token_times(deltas: list[list[float]]) -> list[float]:
    """Each token's delivery time (ms from arrival): a delta's tokens all arrive with it."""
    return [t for t, n in deltas for _ in range(int(n))]


def pair(ours: dict[str, Any], peer: dict[str, Any], tail: dict[str, Any] | None,
         steps: list[dict[str, Any]] | None, top: int = 3) -> dict[str, Any]:  # fmt: skip
    """One request in both runs: TPOTs, the lag's growth by our step kind and gap size, and
    the ``top`` largest growths with what each engine ran then."""
    a, b = token_times(ours["deltas_ms"]), token_times(peer["deltas_ms"])
    n = min(len(a), len(b))
    tail_gaps = (tail or {}).get("gaps", [])  # one per delta after the first, in order
    by_kind: dict[str, float] = {}
    by_size: dict[str, float] = {}
    growths = []
    j = 0  # tokens delivered before the gap
    for k, (t, tokens) in enumerate(ours["deltas_ms"]):
        tokens = int(tokens)
        if k == 0:
            j = tokens
            continue
        last = min(j + tokens, n) - 1
        if last < j:
            break
        gap = t - ours["deltas_ms"][k - 1][0]
        grow = (a[last] - b[last]) - (a[j - 1] - b[j - 1])
        g = tail_gaps[k - 1] if k - 1 < len(tail_gaps) else None
        kind = _kind(g)
        size = size_class(gap, tokens)
        by_kind[kind] = by_kind.get(kind, 0.0) + grow
        by_size[size] = by_size.get(size, 0.0) + grow
        growths.append((grow, t, gap, tokens, kind, g, b[j - 1], b[last]))
        j += tokens
    growths.sort(key=lambda x: -x[0])
    arrival = peer.get("arrival_ms")
    return {
        "request_id": ours["request_id"],
        "tpot_ms": ours["tpot_ms"], "peer_tpot_ms": peer["tpot_ms"],
        "num_output": ours["num_output"],
        "ttft_lag_ms": round(a[0] - b[0], 3),
        "decode_lag_ms": round((a[n - 1] - b[n - 1]) - (a[0] - b[0]), 3),
        "lag_by_kind_ms": _rounded(by_kind),
        "lag_by_size_ms": _rounded(by_size),
        "gaps_by_size": {"ours": _sizes(ours["deltas_ms"]), "peer": _sizes(peer["deltas_ms"])},
        "largest": [
            {"at_ms": round(t, 3), "lag_growth_ms": round(grow, 3), "gap_ms": round(gap, 3),
             "tokens": tokens, "kind": kind,
             "step": None if g is None else {"lane": g[5], "tokens": g[6], "ms": g[7],
                                             "role": g[3]},
             "peer_steps": _peer_steps(steps, arrival, p0, p1)}
            for grow, t, gap, tokens, kind, g, p0, p1 in growths[:top]
        ],
    }  # fmt: skip


def _kind(gap_row: list | None) -> str:
    """Our step's kind for a gap of the ITL anatomy: its lane, ``+prompt`` when a prompt step
    ran during the gap; ``unknown`` without the anatomy."""
    if gap_row is None:
        return "unknown"
    lane, shared = gap_row[5] or "unmatched", gap_row[4]
    return f"{lane}+prompt" if shared and lane not in ("mixed", "prefill") else lane


def _sizes(deltas: list[list[float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (t0, _), (t1, n) in zip(deltas, deltas[1:], strict=False):
        cls = out.setdefault(size_class(t1 - t0, int(n)), {"gaps": 0, "ms": 0.0})
        cls["gaps"] += 1
        cls["ms"] = round(cls["ms"] + t1 - t0, 3)
    return out


def _peer_steps(steps: list[dict[str, Any]] | None, arrival: float | None, t0: float,
                t1: float) -> list[dict[str, Any]] | None:  # fmt: skip
    """The peer's logged engine steps that ended in (t0, t1] ms after the request's arrival."""
    if steps is None or arrival is None:
        return None
    lo, hi = arrival + t0, arrival + t1
    return [s for s in steps if lo < s["t_ms"] <= hi]


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}


def _row(report: dict[str, Any], rate: float, mode: str | None, profile: str,
         temperature: float) -> dict[str, Any]:  # fmt: skip
    for row in report.get("sweep", []):
        key = (row["rate"], row["acceptance_profile"], row["temperature"])
        if key == (rate, profile, temperature) and mode in (None, row["mode"]):
            return row
    raise SystemExit(f"no row at rate {rate}, {profile}, T={temperature}, mode {mode or 'any'}")


def compare(ours_row: dict[str, Any], peer_row: dict[str, Any]) -> dict[str, Any]:
    """Every request in both rows' slowest-TPOT lists, paired (``pair``), and the lag's growth
    summed over them by our step kind and by gap size."""
    mine = {r["request_id"]: r for r in (ours_row.get("slowest") or {}).get("tpot", [])}
    theirs = {r["request_id"]: r for r in (peer_row.get("slowest") or {}).get("tpot", [])}
    tails = {t["request_id"]: t for t in (ours_row.get("itl_anatomy") or {}).get("tpot_tail", [])}
    common = [rid for rid in mine if rid in theirs and "deltas_ms" in mine[rid]
              and "deltas_ms" in theirs[rid]]  # fmt: skip
    pairs = [pair(mine[r], theirs[r], tails.get(r), peer_row.get("engine_steps")) for r in common]
    total: dict[str, dict[str, float]] = {"kind": {}, "size": {}}
    sizes: dict[str, dict[str, dict[str, float]]] = {"ours": {}, "peer": {}}
    for p in pairs:
        for key in ("kind", "size"):
            for k, v in p[f"lag_by_{key}_ms"].items():
                total[key][k] = total[key].get(k, 0.0) + v
        for side, classes in p["gaps_by_size"].items():
            for name, c in classes.items():
                acc = sizes[side].setdefault(name, {"gaps": 0, "ms": 0.0})
                acc["gaps"] += c["gaps"]
                acc["ms"] = round(acc["ms"] + c["ms"], 3)
    return {
        "rate": ours_row["rate"], "mode": ours_row["mode"], "peer_mode": peer_row["mode"],
        "tpot_p99_ms": ours_row["tpot_p99_ms"], "peer_tpot_p99_ms": peer_row["tpot_p99_ms"],
        "num_paired": len(pairs),
        "lag_by_kind_ms": _rounded(total["kind"]), "lag_by_size_ms": _rounded(total["size"]),
        "gaps_by_size": sizes,
        "pairs": pairs,
    }  # fmt: skip


def _signed(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:+.1f}" for k, v in d.items())


def lines(out: dict[str, Any]) -> list[str]:
    head = ["request", "TPOT ours", "peer", "tokens", "TTFT lag", "decode lag", "lag by kind"]
    cells = [[p["request_id"], p["tpot_ms"], p["peer_tpot_ms"], p["num_output"], p["ttft_lag_ms"],
              p["decode_lag_ms"], _signed(p["lag_by_kind_ms"])] for p in out["pairs"]]  # fmt: skip
    return [
        f"rate {out['rate']}: TPOT p99 {out['tpot_p99_ms']:.2f} ({out['mode']}) against "
        f"{out['peer_tpot_p99_ms']:.2f} ({out['peer_mode']}), {out['num_paired']} requests paired",
        format_table(head, cells) if cells else "(no request in both slowest-TPOT lists)",
        "lag by our step kind (ms, summed): " + _signed(out["lag_by_kind_ms"]),
        "lag by our gap size: " + _signed(out["lag_by_size_ms"]),
        "gaps by size, ours / peer (count, ms): "
        + ", ".join(
            f"{name} {_count(out, 'ours', name)} / {_count(out, 'peer', name)}"
            for name in (n for _, n in SIZE_BOUNDS_MS)
        ),
    ]


def _count(out: dict[str, Any], side: str, name: str) -> str:
    c = out["gaps_by_size"][side].get(name, {"gaps": 0, "ms": 0.0})
    return f"{c['gaps']}, {c['ms']:.0f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ours")
    p.add_argument("peer")
    p.add_argument("--rate", type=float, action="append", required=True,
                   help="a rate of both runs (repeatable)")  # fmt: skip
    p.add_argument("--mode", default="policy", help="our row's mode (default: policy)")
    p.add_argument("--peer-mode", default=None, help="the peer's row's mode (default: any)")
    p.add_argument("--profile", default="hetero")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = p.parse_args(argv)
    ours, peer = load_result(args.ours), load_result(args.peer)
    pick = lambda rep, rate, mode: _row(rep, rate, mode, args.profile, args.temperature)  # noqa: E731
    result = {
        "command": " ".join(["python", "bench/tpot_pairs.py", *(argv or sys.argv[1:])]),
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "ours": args.ours, "peer": args.peer, "device": ours.get("device"),
        "git_commit": ours.get("git_commit"), "peer_git_commit": peer.get("git_commit"),
        "rates": [compare(pick(ours, r, args.mode), pick(peer, r, args.peer_mode))
                  for r in args.rate],
    }  # fmt: skip
    for out in result["rates"]:
        print("\n".join(lines(out)))
    if args.out:
        write_json(Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
