"""Report of the rate sweep (issue 14): the table, the plots (p99 ITL, p99 TTFT and goodput
against rate per acceptance profile and temperature, one line per mode; the policy's decisions
over time), and the merge of a verifypd sweep JSON (bench/mixed.py --sweep) with the sweeps of
the same traces over HTTP (mixed.py --sweep --http) and through vLLM (peer_vllm.py sweep).

    python bench/sweep_report.py OURS.json [OURS2.json ...] [--vllm VLLM.json] \
        [--http HTTP.json ...] [--repeat AGAIN.json ...] [--out MERGED.json]

Several OURS files of one plan (one mode per run, to fit a device time limit) are joined.

The merged JSON holds every row, the criteria of bench/sweep_criteria.py over the in-process
rows, and "policy ahead of vLLM on TTFT, ITL and TPOT p99 at every rate" against each vLLM file
(each ``policy-NAME`` mode, and each ``policy-http-NAME`` server label, judged on its own too).
With ``--repeat`` (another run of the same plan, e.g. the same commit in another call) it also
holds ``repeat_spread``: how far the two runs differ per metric, the noise the criteria's 5 %
sits in, and ``repeat_misses``: which of the policy's within-5 % misses the repeat misses too.
With ``--ab OLD.json ...`` (the same plan run by other code, e.g. the commit before a change, in
the same call) it holds ``ab``: the new / old ratio of every cell per metric
(bench/sweep_ab.py), and ``ab_sweep``: the old rows as ``MODE@COMMIT``, which its plot draws
beside the new ones (the criteria judge the new rows only).

    python bench/sweep_report.py NEW.json --ab OLD.json --out AB.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import format_table, write_json  # noqa: E402
from intervals import clear_miss  # noqa: E402
from result_files import load_result, row_count, slim_row  # noqa: E402
from sweep_ab import ab_compare, ab_lines  # noqa: E402
from sweep_criteria import (  # noqa: E402
    criteria,
    criteria_lines,
    repeat_spread,
    replicated_lines,
    replicated_misses,
    spread_lines,
)

# plot_rates, columnar and timeline_samples stay importable from here (tools and tests use them)
from sweep_plots import columnar, plot_all, plot_rates, timeline_samples  # noqa: E402, F401

# ----------------------------------------------------------------------------- table
HEADERS = ["profile", "temp", "rate", "mode", "TTFT p50", "p99", "ITL p50", "p99", "TPOT p50",
           "p99", "goodput", "tok/s", "accept", "done"]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    order = sorted(rows, key=lambda r: (r["acceptance_profile"], r["temperature"], r["rate"]))
    cells = [[r["acceptance_profile"], r["temperature"], r["rate"], r["mode"],
              r.get("ttft_p50_ms"), r.get("ttft_p99_ms"), r.get("itl_p50_ms"),
              r.get("itl_p99_ms"), r.get("tpot_p50_ms"), r.get("tpot_p99_ms"),
              r.get("goodput_rps"), r.get("output_tok_s"), r.get("acceptance_rate"),
              f"{r.get('num_finished')}/{r.get('num_requests')}"] for r in order]  # fmt: skip
    return format_table(HEADERS, cells)


def event_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What a row's p99s include besides the traffic: Triton compiles under it (each a stall of
    every lane) and decode rows fused into prompt steps (``fuse_decode_backlog_s``), in-process
    or from the server's counters; rows with neither say nothing."""
    lines = []
    for r in rows:
        compiles, fused = row_count(r, "kernel_compiles"), row_count(r, "decode_rows_fused")
        cell = f"{r['mode']} {r['acceptance_profile']} T={r['temperature']} {r['rate']}/s"
        if compiles:
            lines.append(f"STALL {cell}: {compiles:g} Triton compiles under traffic")
        if fused:
            lines.append(f"fused {cell}: {fused:g} decode rows inside prompt steps")
    return lines


# ----------------------------------------------------------------------------- vLLM
def ahead_of_vllm(rows: list[dict[str, Any]], vllm_rows: list[dict[str, Any]],
                  policy: str = "policy") -> dict[str, Any]:  # fmt: skip
    """Policy strictly lower than vLLM on TTFT, ITL and TPOT p99 at every rate (matched by
    rate and temperature; vLLM runs without speculation, so one vLLM row serves every
    acceptance profile of the same trace). Where both rows carry bootstrap intervals, each
    metric also says whether the side ahead is ``clear`` (its interval's high end below the
    other's low end: a lead no rerun of this load is likely to turn); the block counts the
    metrics clearly behind and clearly ahead."""
    theirs = {(r["rate"], r["temperature"]): r for r in vllm_rows}
    checks = []
    for r in sorted(rows, key=lambda r: (r["acceptance_profile"], r["temperature"], r["rate"])):
        v = theirs.get((r["rate"], r["temperature"]))
        if r["mode"] != policy or v is None:
            continue
        chk: dict[str, Any] = {"acceptance_profile": r["acceptance_profile"],
                               "temperature": r["temperature"], "rate": r["rate"]}  # fmt: skip
        ok = True
        for metric in _P99S:
            mine, vl = r.get(metric), v.get(metric)
            ahead = mine is not None and vl is not None and mine < vl
            lead = (r, v) if not ahead else (v, r)  # (the side behind, the side ahead)
            chk[metric] = {"policy": mine, "vllm": vl}
            if (clear := clear_miss(*lead, metric, 0.0)) is not None:
                chk[metric]["clear"] = clear
            ok = ok and ahead
        checks.append({**chk, "ok": ok})
    if not checks:
        return {"verdict": "N/A", "reason": "no policy row with a vLLM row at its rate",
                "checks": []}  # fmt: skip
    misses = sum(not c["ok"] for c in checks)
    out = {"verdict": "MISS" if misses else "PASS", "num_checks": len(checks),
           "num_misses": misses, "checks": checks}  # fmt: skip
    cells = [(c[m]["policy"] < c[m]["vllm"], c[m]["clear"]) for c in checks for m in _P99S
             if "clear" in c[m]]  # fmt: skip
    if cells:
        out["num_clearly_ahead"] = sum(ahead and clear for ahead, clear in cells)
        out["num_clearly_behind"] = sum(not ahead and clear for ahead, clear in cells)
        out["num_weighed"] = len(cells)
    return out


_P99S = ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms")


def vllm_lines(block: dict[str, Any], label: str) -> list[str]:
    head = f"{block['verdict']:4} policy ahead of {label} on TTFT/ITL/TPOT p99 at every rate"
    if block["verdict"] == "N/A":
        return [f"{head}: {block['reason']}"]
    clear = ""
    if "num_weighed" in block:
        clear = (f" (of {block['num_weighed']} p99s with intervals:"
                 f" {block['num_clearly_ahead']} clearly ahead,"
                 f" {block['num_clearly_behind']} clearly behind; * = clear)")  # fmt: skip
    lines = [f"{head}: {block['num_checks'] - block['num_misses']}/{block['num_checks']} ok{clear}"]
    for c in block["checks"]:
        nums = ", ".join(f"{m.split('_')[0]} {c[m]['policy']:.1f} vs {c[m]['vllm']:.1f}"
                         f"{'*' if c[m].get('clear') else ''}"
                         if c[m]["policy"] is not None and c[m]["vllm"] is not None
                         else f"{m} missing" for m in _P99S)  # fmt: skip
        lines.append(f"  {'ok  ' if c['ok'] else 'MISS'} {c['acceptance_profile']} "
                     f"t={c['temperature']} rate={c['rate']}: {nums}")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------- merge
def http_sitting(http: list[dict[str, Any]]) -> dict[str, Any]:
    """No in-process rows: the first HTTP run's device, commit and plan, and no rows."""
    keys = ("device", "git_commit", "sweep_config", "slo")
    return {**{k: http[0].get(k) for k in keys}, "command": None, "sweep": []}


def join_ours(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``mixed.py --sweep`` JSONs of one plan (e.g. one mode per run, to fit a time
    limit) as one: their rows and policy timelines together; a different plan is an error."""
    first = parts[0]
    for p in parts[1:]:
        if p.get("sweep_config") != first.get("sweep_config"):
            raise ValueError(f"different sweep plans: {p.get('command')} vs {first.get('command')}")
    commits = sorted({p.get("git_commit") for p in parts}, key=str)
    return {
        **first, "git_commit": commits[0] if len(commits) == 1 else commits,
        "command": [p.get("command") for p in parts] if len(parts) > 1 else first.get("command"),
        "sweep": [r for p in parts for r in p["sweep"]],
        "policy_timeline": [t for p in parts for t in p.get("policy_timeline", [])],
    }  # fmt: skip


# ``mixed.py --sweep --http --mode-label``: the labels of our policy server's rows and of vLLM's
# OpenAI server's rows
HTTP_POLICY = ("policy", "policy-http")
HTTP_VLLM = ("vllm", "vllm-http")


def merge(ours: dict[str, Any], vllm: list[dict[str, Any]], http: list[dict[str, Any]]):
    """One report: our rows, the HTTP rows, the vLLM rows, our criteria and the ahead-of-vLLM
    criterion twice: the in-process policy rows against the in-process vLLM rows, and our HTTP
    policy rows against vLLM's HTTP rows (the same client against both servers) or, without
    those, against the in-process vLLM rows."""
    rows = list(ours["sweep"])
    out: dict[str, Any] = {
        "device": ours.get("device"), "git_commit": ours.get("git_commit"),
        "sources": {"verifypd": ours.get("command"), "vllm": [v.get("command") for v in vllm],
                    "http": [h.get("command") for h in http]},
        "sweep_config": ours.get("sweep_config"), "slo": ours.get("slo"),
        "criteria": criteria(rows), "policy_timeline": ours.get("policy_timeline", []),
    }  # fmt: skip
    variants = policy_variants(rows)  # each judged on its own, against its own front's modes
    if variants:
        out["criteria_variants"] = {v: criteria(rows, v) for v in variants}
    http_rows = [dict(r, mode=f"http:{r['mode']}") for h in http for r in h["sweep"]]
    vllm_rows = [r for v in vllm for r in v["sweep"]]
    out["sweep"] = rows + http_rows + vllm_rows
    http_vllm = [r for h in http for r in h["sweep"] if r["mode"] in HTTP_VLLM]
    out["criteria"]["policy_ahead_of_vllm"] = ahead_of_vllm(rows, vllm_rows)
    for mode in policy_variants(rows) if vllm_rows else []:  # e.g. policy-burst, on its own
        mine = [dict(r, mode="policy") for r in rows if r["mode"] == mode]
        out["criteria"].setdefault("variants_ahead_of_vllm", {})[mode] = ahead_of_vllm(
            mine, vllm_rows
        )
    # over HTTP against vLLM's server driven by the same client when that was run, else
    # against the in-process vLLM rows
    http_ref = http_vllm or vllm_rows
    front = "http" if http_vllm else "in-process"
    labels = http_policy_labels(http)
    for label in labels:
        mine = [dict(r, mode="policy") for h in http for r in h["sweep"] if r["mode"] == label]
        judged = {**ahead_of_vllm(mine, http_ref), "vllm_front": front}
        if label in HTTP_POLICY:
            out["criteria"]["http_policy_ahead_of_vllm"] = judged
        else:  # another server variant of the policy (e.g. policy-http-proc)
            out["criteria"].setdefault("http_variants_ahead_of_vllm", {})[label] = judged
    if not any(label in HTTP_POLICY for label in labels):
        out["criteria"]["http_policy_ahead_of_vllm"] = {**ahead_of_vllm([], http_ref),
                                                         "vllm_front": front}  # fmt: skip
    return out


def policy_variants(rows: list[dict[str, Any]]) -> list[str]:
    """The in-process modes that are variants of the policy (``policy-NAME``), in order."""
    return list(dict.fromkeys(r["mode"] for r in rows if r["mode"].startswith("policy-")))


def http_policy_labels(http: list[dict[str, Any]]) -> list[str]:
    """The HTTP rows' policy labels in order: ``policy`` / ``policy-http``, and variants of
    our server run under ``policy-http-NAME`` (e.g. ``--engine-process``), each judged on its
    own against vLLM."""
    seen: dict[str, None] = {}
    for h in http:
        for r in h["sweep"]:
            if r["mode"] in HTTP_POLICY or r["mode"].startswith("policy-http-"):
                seen[r["mode"]] = None
    return list(seen)


def report_lines(merged: dict[str, Any]) -> list[str]:
    crit = dict(merged["criteria"])
    lines = criteria_lines({k: v for k, v in crit.items() if "vllm" not in k})
    for mode, block in merged.get("criteria_variants", {}).items():
        lines += [f"{mode}:"] + ["  " + line for line in criteria_lines(block)]
    lines += vllm_lines(crit["policy_ahead_of_vllm"], "vLLM (in-process)")
    for mode, judged in crit.get("variants_ahead_of_vllm", {}).items():
        lines += vllm_lines(judged, f"vLLM (in-process, {mode} rows)")
    front = crit["http_policy_ahead_of_vllm"].get("vllm_front", "in-process")
    lines += vllm_lines(crit["http_policy_ahead_of_vllm"], f"vLLM (HTTP policy rows vs {front})")
    for label, judged in crit.get("http_variants_ahead_of_vllm", {}).items():
        lines += vllm_lines(judged, f"vLLM (HTTP {label} rows vs {front})")
    return lines


def relabel(result: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``result`` with its rows' modes renamed by ``names`` (each renamed row keeps the run's
    own label as ``mode_label``)."""
    if not names:
        return result
    rows = [dict(r, mode=names[r["mode"]], mode_label=r["mode"]) if r["mode"] in names else r
            for r in result["sweep"]]  # fmt: skip
    return {**result, "sweep": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("ours", nargs="*", help="bench/mixed.py --sweep JSONs (one plan); none: "
                   "an HTTP sitting alone (--http), judged against vLLM's server")  # fmt: skip
    p.add_argument("--vllm", nargs="*", default=[], help="peer_vllm.py sweep JSONs")
    p.add_argument("--http", nargs="*", default=[], help="mixed.py --sweep --http JSONs")
    p.add_argument("--repeat", nargs="*", default=[], help="another run of the same plan")
    p.add_argument("--ab", nargs="*", default=[], help="the same plan run by other code")
    p.add_argument("--out", default=None, help="output JSON (default: OURS-merged.json)")
    p.add_argument("--label", nargs="*", default=[], metavar="OLD=NEW",
                   help="read the --http rows labelled OLD (a run's --mode-label) as NEW, e.g. "
                        "ours-ep=policy-http-proc")  # fmt: skip
    args = p.parse_args(argv)
    try:
        names = dict(item.split("=", 1) for item in args.label)
    except ValueError:
        p.error(f"--label: expected OLD=NEW, got {args.label}")
    if not args.ours and not args.http:
        p.error("give the in-process sweep JSONs, or --http")
    http = [relabel(load_result(f), names) for f in args.http]
    ours = join_ours([load_result(f) for f in args.ours]) if args.ours else http_sitting(http)
    merged = merge(ours, [load_result(f) for f in args.vllm], http)
    if args.repeat:
        again = join_ours([load_result(f) for f in args.repeat])
        if again.get("sweep_config") != ours.get("sweep_config"):
            p.error("--repeat: a different sweep plan")
        merged["repeat_spread"] = repeat_spread(ours["sweep"], again["sweep"])
        merged["repeat_misses"] = replicated_misses(ours["sweep"], again["sweep"])
        merged["sources"]["repeat"] = again.get("command")
    if args.ab:
        before = join_ours([load_result(f) for f in args.ab])
        if before.get("sweep_config") != ours.get("sweep_config"):
            p.error("--ab: a different sweep plan")
        merged["ab"] = {"new": ours.get("git_commit"), "old": before.get("git_commit"),
                        **ab_compare(ours["sweep"], before["sweep"])}  # fmt: skip
        merged["sources"]["ab"] = before.get("command")
        label = before.get("git_commit") or "old"  # drawn beside the new rows, not judged
        merged["ab_sweep"] = [dict(r, mode=f"{r['mode']}@{label}") for r in before["sweep"]]
    first = Path((args.ours or args.http)[0])
    out = Path(args.out) if args.out else first.with_name(first.stem + "-merged.json")
    # the policy timelines (hundreds of KB each) and the rows' diagnostics (ROW_DETAIL) stay in
    # the runs' own files (their sidecars, result_files.py): the report keeps the numbers the
    # criteria read and names the runs that hold the timelines
    timeline_in = [Path(f).name for f in args.ours] if merged["policy_timeline"] else []
    written = {k: v for k, v in merged.items() if k not in ("policy_timeline", "sweep", "ab_sweep")}
    if "ab_sweep" in merged:
        written["ab_sweep"] = [slim_row(r) for r in merged["ab_sweep"]]
    write_json(out, {**written, "sweep": [slim_row(r) for r in merged["sweep"]],
                     "policy_timeline_in": timeline_in})  # fmt: skip
    if args.vllm or args.http or args.ab or len(args.ours) > 1:  # else the run's own plots
        # the policy's timeline only when joined from several runs (one run's is its own plot)
        timeline = merged["policy_timeline"] if len(args.ours) > 1 else []
        plot_all(out.with_suffix(".png"), merged["sweep"] + merged.get("ab_sweep", []), timeline)
    print(table(merged["sweep"]))
    print("\n".join(event_lines(merged["sweep"]) + report_lines(merged)))
    if "repeat_spread" in merged:
        print("\n".join(spread_lines(merged["repeat_spread"])))
        print("\n".join(replicated_lines(merged["repeat_misses"])))
    if "ab" in merged:
        print("\n".join(ab_lines(merged["ab"], str(merged["ab"]["new"]), str(merged["ab"]["old"]))))
    print(f"wrote {out}")
    return merged


if __name__ == "__main__":
    main()
