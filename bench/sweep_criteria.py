"""The criteria of issue 14's rate sweep over its summary rows (bench/sweep.py's
``summary_row``): the policy within 5 % of the best other mode at every rate and profile, +15 %
goodput with the ``hetero`` profile at some rate, TPOT p50 1.5x faster than ``off`` at the
lightest rate; and how far two runs of one plan differ (``repeat_spread``) and which misses a
repeat shares (``replicated_misses``). Pure functions of the rows."""

from __future__ import annotations

from typing import Any

import numpy as np
from intervals import clear_miss

LOWER_BETTER = ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms")


def _groups(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        key = (r["acceptance_profile"], r["temperature"], r["rate"])
        out.setdefault(key, {})[r["mode"]] = r
    return out


def _verdict(checks: list[dict[str, Any]], reason: str = "") -> dict[str, Any]:
    """PASS only without a miss; where misses were weighed against the rows' bootstrap
    intervals (``clear_miss``), also how many are clear of them."""
    if not checks:
        return {"verdict": "N/A", "reason": reason or "no rows to judge", "checks": []}
    misses = [c for c in checks if not c["ok"]]
    out = {"verdict": "MISS" if misses else "PASS", "num_checks": len(checks),
           "num_misses": len(misses), "checks": checks}  # fmt: skip
    weighed = [c["clear_miss"] for c in misses if c.get("clear_miss") is not None]
    if weighed:
        out["num_clear_misses"] = sum(weighed)
        out["num_misses_weighed"] = len(weighed)
    return out


def within_best(rows: list[dict[str, Any]], policy: str = "policy", tol: float = 0.05):
    """At every (profile, temperature, rate): policy's p99s within ``tol`` of the best other
    mode's (lower is better) and its goodput at least (1 - tol) of the best other's."""
    checks = []
    for (profile, temp, rate), modes in sorted(_groups(rows).items()):
        if policy not in modes or len(modes) < 2:
            continue
        ours = modes[policy]
        others = {m: r for m, r in modes.items() if m != policy}
        for metric in (*LOWER_BETTER, "goodput_rps"):
            vals = {m: r.get(metric) for m, r in others.items() if r.get(metric) is not None}
            if not vals:
                continue
            higher = metric == "goodput_rps"
            best_mode = (max if higher else min)(vals, key=vals.get)
            best, mine = vals[best_mode], ours.get(metric)
            if mine is None:
                ok, ratio = False, None
            elif higher:
                ok, ratio = mine >= (1 - tol) * best, (mine / best if best else None)
            else:
                ok, ratio = mine <= (1 + tol) * best, (mine / best if best else None)
            check = {"acceptance_profile": profile, "temperature": temp, "rate": rate,
                     "metric": metric, "policy": mine, "best_other": best,
                     "best_mode": best_mode, "ratio": ratio, "ok": bool(ok)}  # fmt: skip
            if not ok and not higher:  # is the miss clear of both rows' intervals?
                check["clear_miss"] = clear_miss(ours, others[best_mode], metric, tol)
            checks.append(check)
    return _verdict(checks, f"needs mode {policy!r} and another mode")


def _gain(mine: float, best: float) -> float:
    """The policy's goodput over the best other mode's, minus 1 (inf when only it has any)."""
    return mine / best - 1 if best else (float("inf") if mine else 0.0)


def hetero_goodput_gain(rows: list[dict[str, Any]], policy: str = "policy", gain: float = 0.15):
    """With ``hetero``: per temperature, is there a rate where policy's goodput beats every
    other mode's by ``gain``? One check per temperature (its best rate)."""
    checks = []
    by_temp: dict[float, list[dict[str, Any]]] = {}
    for (profile, temp, rate), modes in sorted(_groups(rows).items()):
        if profile != "hetero" or policy not in modes or len(modes) < 2:
            continue
        mine = modes[policy].get("goodput_rps") or 0.0
        best_mode, best = max(((m, r.get("goodput_rps") or 0.0) for m, r in modes.items()
                               if m != policy), key=lambda x: x[1])  # fmt: skip
        g = _gain(mine, best)
        by_temp.setdefault(temp, []).append({"rate": rate, "policy": mine, "best_other": best,
                                             "best_mode": best_mode, "gain": g})  # fmt: skip
    for temp, cands in sorted(by_temp.items()):
        top = max(cands, key=lambda c: c["gain"])
        checks.append({"temperature": temp, **top, "ok": top["gain"] >= gain, "per_rate": cands})
    return _verdict(checks, f"needs the hetero profile with {policy!r} and another mode")


def goodput_gain_by_tpot_slo(
    rows: list[dict[str, Any]], policy: str = "policy", gain: float = 0.15
) -> list[dict[str, Any]]:
    """``hetero_goodput_gain`` at each TPOT target of the rows' ``goodput_by_tpot_slo`` (the
    plan's TTFT target kept): per (temperature, TPOT target) the rate where the policy's goodput
    is furthest ahead of (or least behind) every other mode's. Not a verdict: the stated SLO's
    is ``hetero_goodput_gain``; this says at which targets speculation decides goodput. Against
    the modes that are not a policy variant (``_judged``)."""
    out: dict[tuple[float, str], dict[str, Any]] = {}
    for (profile, temp, rate), modes in sorted(_groups(_judged(rows, policy)).items()):
        if profile != "hetero" or policy not in modes or len(modes) < 2:
            continue
        for slo, mine in (modes[policy].get("goodput_by_tpot_slo") or {}).items():
            others = {m: (r.get("goodput_by_tpot_slo") or {}).get(slo) for m, r in modes.items()}
            others = {m: v for m, v in others.items() if m != policy and v is not None}
            if mine is None or not others:
                continue
            best_mode = max(others, key=others.get)
            best = others[best_mode]
            g = _gain(mine, best)
            cur = out.get((temp, slo))
            if cur is None or g > cur["gain"]:
                out[(temp, slo)] = {"temperature": temp, "tpot_slo_ms": float(slo), "rate": rate,
                                    "policy": mine, "best_other": best, "best_mode": best_mode,
                                    "gain": g, "ok": g >= gain}  # fmt: skip
    return sorted(out.values(), key=lambda c: (c["temperature"], c["tpot_slo_ms"]))


def goodput_ladder_lines(checks: list[dict[str, Any]]) -> list[str]:
    """One line per (temperature, TPOT target): the policy's best goodput gain and where."""
    lines = []
    for c in checks:
        mark = "+15%" if c["ok"] else "    "
        lines.append(
            f"  {mark} T={c['temperature']:g} TPOT <= {c['tpot_slo_ms']:g} ms: "
            f"{c['gain']:+.0%} at {c['rate']:g} req/s (policy {_fmt(c['policy'])}, "
            f"best other {c['best_mode']} {_fmt(c['best_other'])} req/s)"
        )
    return lines


def light_load_tpot(rows: list[dict[str, Any]], policy: str = "policy", factor: float = 1.5):
    """At the lightest rate, policy's TPOT p50 at least ``factor`` x faster than ``off`` (through
    the same front: ``off-proc`` for ``policy-proc``); the verdict is on ``hetero`` (the issue's
    target), other profiles are listed (``judged``)."""
    checks = []
    groups = _groups(rows)
    lightest = min((k[2] for k in groups), default=None)
    off_mode = "off" + front_of(policy)  # through the policy's own front
    for (profile, temp, rate), modes in sorted(groups.items()):
        if rate != lightest or policy not in modes or off_mode not in modes:
            continue
        mine, off = modes[policy].get("tpot_p50_ms"), modes[off_mode].get("tpot_p50_ms")
        speedup = off / mine if mine and off else None
        check = {"acceptance_profile": profile, "temperature": temp, "rate": rate,
                 "policy_tpot_p50_ms": mine, "off_tpot_p50_ms": off, "speedup": speedup,
                 "judged": profile == "hetero",
                 "ok": speedup is not None and speedup >= factor}  # fmt: skip
        by_alpha = _speedup_by_alpha(modes[policy], modes[off_mode])
        if by_alpha:
            check["speedup_by_alpha"] = by_alpha
        checks.append(check)
    judged = [c for c in checks if c["judged"]]
    out = _verdict(judged, f"needs the hetero profile with {policy!r} and {off_mode!r}")
    out["all_profiles"] = checks
    return out


def _speedup_by_alpha(mine: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    """``off``'s TPOT p50 over the policy's, per acceptance class both rows have."""
    a, b = mine.get("tpot_by_alpha") or {}, off.get("tpot_by_alpha") or {}
    return {k: round(b[k]["tpot_p50_ms"] / a[k]["tpot_p50_ms"], 3)
            for k in a if k in b and a[k]["tpot_p50_ms"]}  # fmt: skip


SPREAD_METRICS = (*LOWER_BETTER, "goodput_rps", "tpot_p50_ms")


def repeat_spread(
    rows: list[dict[str, Any]], again: list[dict[str, Any]], tol: float = 0.05
) -> dict[str, Any]:
    """How far two runs of the same plan differ, per metric, over the (profile, temperature,
    rate, mode) cells both have: the median and largest relative difference |b / a - 1| and
    the share of cells where it exceeds ``tol`` (the margin the criteria judge at). A check
    whose margin is inside that spread says little about the code."""
    theirs = {(r["acceptance_profile"], r["temperature"], r["rate"], r["mode"]): r
              for r in again}  # fmt: skip
    out: dict[str, Any] = {"tolerance": tol}
    for metric in SPREAD_METRICS:
        diffs = []
        for r in rows:
            o = theirs.get((r["acceptance_profile"], r["temperature"], r["rate"], r["mode"]))
            a, b = r.get(metric), (o or {}).get(metric)
            if a and b is not None:
                diffs.append(abs(b / a - 1.0))
        if diffs:
            out[metric] = {"cells": len(diffs), "median": float(np.median(diffs)),
                           "max": max(diffs),
                           "share_above_tol": sum(d > tol for d in diffs) / len(diffs)}  # fmt: skip
    return out


def replicated_misses(
    rows: list[dict[str, Any]], again: list[dict[str, Any]], policy: str = "policy"
) -> dict[str, Any]:
    """The within-5 % checks that miss in ``rows``, each marked ``replicated`` when the same
    check (profile, temperature, rate, metric) misses in ``again``, another run of the same
    plan: a miss in one run only may be the noise that ``repeat_spread`` measures, a miss in
    both is a loss to act on."""
    theirs = {_check_key(c): c for c in within_best(_judged(again, policy), policy)["checks"]}
    misses = []
    for c in within_best(_judged(rows, policy), policy)["checks"]:
        other = theirs.get(_check_key(c))
        if c["ok"] or other is None:
            continue
        misses.append({**c, "repeat_ratio": other["ratio"], "replicated": not other["ok"]})
    return {"misses": len(misses), "replicated": sum(m["replicated"] for m in misses),
            "checks": misses}  # fmt: skip


def replicated_lines(rep: dict[str, Any]) -> list[str]:
    ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [f"misses replicated in the repeat: {rep['replicated']} of {rep['misses']}"]
    for m in rep["checks"]:
        if m["replicated"]:
            lines.append(f"  rate={m['rate']:g} {m['acceptance_profile']} T={m['temperature']:g} "
                         f"{m['metric']}: {ratio(m['ratio'])} and {ratio(m['repeat_ratio'])} "
                         "of the best other mode")  # fmt: skip
    return lines


def spread_lines(spread: dict[str, Any]) -> list[str]:
    tol = spread["tolerance"]
    lines = [f"run-to-run spread against the repeat (share of cells beyond {tol:.0%}):"]
    for metric in SPREAD_METRICS:
        s = spread.get(metric)
        if s:
            lines.append(f"  {metric}: {s['share_above_tol']:.0%} of {s['cells']} cells, "
                         f"median {s['median']:.1%}, largest {s['max']:.1%}")  # fmt: skip
    return lines


# The label suffix of rows measured through another front (``mixed.py --sweep
# --engine-process``: ``MODE-proc``, each engine in its own process).
FRONT_SUFFIXES = ("-proc",)


def front_of(mode: str) -> str:
    """The front suffix ``mode`` carries (``"-proc"``), or ``""`` for an engine on the load
    generator's loop."""
    return next((s for s in FRONT_SUFFIXES if mode.endswith(s)), "")


def _judged(rows: list[dict[str, Any]], policy: str) -> list[dict[str, Any]]:
    """``policy``'s rows and those of the modes that are not a policy variant (``policy-*``:
    the same policy with other settings, judged on its own) measured through the same front:
    ``policy-proc`` against ``off-proc``, ``three-fixed-proc``, ..., not against the rows of an
    engine on the load generator's loop (nor those against it)."""
    front = front_of(policy)
    return [r for r in rows if r["mode"] == policy
            or (not r["mode"].startswith("policy") and front_of(r["mode"]) == front)]  # fmt: skip


def _check_key(check: dict[str, Any]) -> tuple:
    return (check["acceptance_profile"], check["temperature"], check["rate"], check["metric"])


def criteria(rows: list[dict[str, Any]], policy: str = "policy") -> dict[str, Any]:
    """The issue's criteria for one policy mode against the modes that are not a policy
    variant (``_judged``)."""
    rows = _judged(rows, policy)
    return {
        "policy_within_5pct_of_best": within_best(rows, policy),
        "hetero_goodput_gain_15pct": hetero_goodput_gain(rows, policy),
        "light_load_tpot_p50_1p5x_off": light_load_tpot(rows, policy),
    }


def policy_variants(rows: list[dict[str, Any]]) -> list[str]:
    """The policy modes other than ``policy`` in the rows (``policy-tight``, ...)."""
    return sorted({r["mode"] for r in rows if r["mode"].startswith("policy-")})


def criteria_lines(block: dict[str, Any]) -> list[str]:
    """One headline per criterion, then every miss with its numbers (never hidden)."""
    lines = []
    for name, c in block.items():
        head = f"{c['verdict']:4} {name}"
        if c["verdict"] == "N/A":
            lines.append(f"{head}: {c['reason']}")
            continue
        clear = ""
        if "num_clear_misses" in c:
            clear = (f" ({c['num_clear_misses']} of {c['num_misses_weighed']} misses clear of"
                     " the bootstrap intervals)")  # fmt: skip
        lines.append(
            f"{head}: {c['num_checks'] - c['num_misses']}/{c['num_checks']} checks ok{clear}"
        )
        for chk in c["checks"]:
            if not chk["ok"] or name != "policy_within_5pct_of_best":
                shown = {k: v for k, v in chk.items() if k not in ("per_rate", "ok", "judged")}
                mark = "ok  " if chk["ok"] else "MISS"
                lines.append(f"  {mark} " + ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))
    return lines


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
