"""``bench/mixed.py --sweep``: the rate sweep of issue 14 (plan, rows and criteria in
``sweep.py``, plots in ``sweep_report.py``). Each mode's engine is built once and runs every
(rate, acceptance profile, temperature) of the plan; with ``--http URL`` the same traces go to
a running OpenAI server instead, rows labelled ``--mode-label``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from common import csv_list, error_record, progress, release_memory
from harness import attach_recorder, build_engine, close_engine, engine_info
from itl_anatomy import anatomy as itl_anatomy
from loadgen import run_load
from process_counters import ProcessCounters
from result_files import SidecarRun, row_count
from sweep import SweepPlan, burn_in, run_trace, summary_row
from sweep_criteria import (
    criteria,
    criteria_lines,
    goodput_gain_by_tpot_slo,
    goodput_ladder_lines,
    policy_variants,
)
from sweep_plots import columnar, plot_all
from sweep_report import table
from ttft_anatomy import StepLog, anatomy

SCRIPT = "mixed"


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (issue 14): --sweep, see bench/sweep.py")
    g.add_argument("--sweep", action="store_true", help="rates x profiles x temperatures")
    # Light load to just below the knee of the default mix on an H100 (7B + 0.5B, 64 slots):
    # `off` and the policy meet the SLO for 91-98 % of requests at 26 req/s and 28-33 % at 32
    # (docs/performance.md, 75ebe42 / e5932b9). Before 2026-11-27: 2,5,8,11,14.
    g.add_argument("--rates", type=csv_floats, default=[2.0, 8.0, 14.0, 20.0, 26.0], help="req/s")
    g.add_argument("--profiles", type=csv_list, default=["uniform-0.8", "uniform-0.6", "hetero"])
    g.add_argument("--temperatures", type=csv_floats, default=[0.0, 0.7])
    g.add_argument("--run-seconds", type=float, default=40.0, help="arrivals stop; 0 = off")
    g.add_argument(
        "--burn-in-s",
        type=float,
        default=45.0,  # 12 s left the first measured engine slower; 45 s did not (H200, 2b08946)
        help="the throwaway engine (or an --http server, or vLLM replaying the sweep) first "
        "serves this many s of another trace at the first rate, unrecorded; 0 = off",
    )
    g.add_argument(
        "--throwaway-engine",
        action=argparse.BooleanOptionalAction,
        # the start-up GEMM warm-up made it unneeded (H200, 15d5fbf); bench/tools/gpu/plan.sh
        # asks for it again since 2026-12-01 (first modes slow on freshly started machines)
        default=False,
        help="build the first mode's engine once more before the measured ones: warm-up and "
        "burn-in, unrecorded, then closed (before EngineConfig.warm_prompt_gemms, a process's "
        "first ~45 s of long prompts ran slower, whichever engine served them; "
        "docs/performance.md)",
    )
    g.add_argument("--slo-ttft-ms", type=float, default=300.0, help="goodput SLO")
    g.add_argument("--slo-tpot-ms", type=float, default=15.0, help="goodput SLO")
    g.add_argument(
        "--max-wall-s",
        type=float,
        default=0.0,
        help="start no run that would end past this many s (its estimate); 0 = off",
    )
    g.add_argument("--estimate-only", action="store_true", help="print the wall-time estimate")
    g.add_argument(
        "--ttft-anatomy",
        action="store_true",
        help="log every lane step and add each row's TTFT parts (bench/ttft_anatomy.py)",
    )
    g.add_argument(
        "--itl-anatomy",
        action="store_true",
        help="log every lane step and add each row's ITL tail by role (bench/itl_anatomy.py)",
    )
    g.add_argument(
        "--engine-process",
        action="store_true",
        help="each mode's engine in its own process (RemoteEngine, as vLLM's AsyncLLM runs its "
        "core); rows labelled MODE-proc (bench/front_sweeps.py)",
    )
    g.add_argument("--http", default=None, help="replay the sweep against this OpenAI server")
    g.add_argument("--mode-label", default="http", help="--http: the rows' mode")
    g.add_argument(
        "--http-extra",
        type=json.loads,
        default={"return_token_ids": True},
        help="--http: extra body fields, JSON (default: return_token_ids, which verifypd and vLLM "
        "honour, so a chunk's tokens are counted exactly; '{}' for other servers)",
    )
    g.add_argument(
        "--http-alpha",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--http: send each request's alpha as synthetic_acceptance",
    )
    g.add_argument(
        "--http-cache-salt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--http: every run's requests carry a cache_salt of their own (vLLM and verifypd "
        "honour it), so a trace replayed at another temperature misses the prefix cache as it "
        "does in-process, where the cache is reset between runs",
    )


def csv_floats(text: str) -> list[float]:
    return [float(x) for x in csv_list(text)]


def plan_of(args, mix, vocab: int) -> SweepPlan:
    return SweepPlan(
        mix=mix, vocab=vocab, seed=args.seed, rates=tuple(args.rates),
        profiles=tuple(args.profiles), temperatures=tuple(args.temperatures),
        num_requests=args.num_requests, run_seconds=args.run_seconds,
        drain_timeout=args.drain_timeout, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, burn_in_s=args.burn_in_s,
    )  # fmt: skip


def run_sweep(run, mix, vocab: int, warmup: list, bench) -> dict[str, Any]:
    """The sweep into ``run.report`` (``bench``: the mixed.py module, its modes and engine
    configs): ``sweep`` rows (saved after every run), the
    ``policy_timeline``, the engines, ``criteria``; then the table, criteria and plots. The
    rows' diagnostics and the timeline are saved beside the JSON, in its sidecar."""
    run = SidecarRun.of(run)
    args, report = run.args, run.report
    plan = plan_of(args, mix, vocab)
    report |= {"sweep_config": plan.to_dict(), "sweep": [], "policy_timeline": [],
               "sweep_engines": {}}  # fmt: skip
    report["slo"] = {"ttft_ms": plan.slo_ttft_ms, "tpot_ms": plan.slo_tpot_ms,
                     "definition": "goodput (DistServe): finished requests/s with TTFT <= "
                     "ttft_ms and TPOT <= tpot_ms, over first arrival -> last token"}  # fmt: skip
    engines = 1 if args.http else len(args.modes)
    # The burn-in is served by an --http server or by the throwaway engine, not by the others.
    est = plan.estimate_s(engines, build_s=0.0 if args.http else 60.0,
                          with_burn_in=bool(args.http) or args.throwaway_engine)  # fmt: skip
    if not args.http and args.throwaway_engine:
        est += 60.0 + 15.0  # its build and warm-up (its burn-in is in the plan's estimate)
    print(f"[{SCRIPT}] sweep: {engines} engine(s) x {len(plan.runs())} runs "
          f"({len(plan.rates)} rates x {len(plan.profiles)} profiles x "
          f"{len(plan.temperatures)} temperatures); estimated wall time {est / 60:.1f} min "
          f"(builds ~60 s each, runs bounded by --run-seconds {args.run_seconds} / "
          f"--num-requests {args.num_requests})", flush=True)  # fmt: skip
    report["estimate_s"] = est
    if args.estimate_only:
        return report
    deadline = time.perf_counter() + args.max_wall_s if args.max_wall_s else None
    report["skipped"] = []
    if args.http:
        from front_sweeps import http_sweep  # imported here: it imports this module

        asyncio.run(http_sweep(run, plan, warmup, deadline))
    else:
        if args.throwaway_engine:
            throwaway_engine(run, plan, args.modes[0], warmup, bench)
            release_memory()
        for name in args.modes:
            if args.engine_process:
                from front_sweeps import remote_engine_sweep

                asyncio.run(remote_engine_sweep(run, plan, name, warmup, bench, deadline))
            else:
                engine_sweep(run, plan, name, warmup, bench, deadline)
            release_memory()
    rows = report["sweep"]
    report["criteria"] = criteria(rows)
    text = table(rows) + "\n\n" + "\n".join(criteria_lines(report["criteria"]))
    ladder = goodput_gain_by_tpot_slo(rows)
    report["goodput_gain_by_tpot_slo"] = ladder
    if ladder:
        text += "\nhetero goodput gain by TPOT target (TTFT target kept):\n"
        text += "\n".join(goodput_ladder_lines(ladder))
    variants = policy_variants(rows)
    if variants:
        report["criteria_variants"] = {v: criteria(rows, v) for v in variants}
        for v, block in report["criteria_variants"].items():
            text += f"\n\n{v}:\n" + "\n".join(criteria_lines(block))
    text += (f"\nms; SLO TTFT <= {plan.slo_ttft_ms} ms and TPOT <= {plan.slo_tpot_ms} ms; "
             f"synthetic acceptance per request (profiles {', '.join(plan.profiles)})")  # fmt: skip
    run.finish(text, lambda png: plot_all(png, rows, report["policy_timeline"]))
    return report


def engine_sweep(
    run, plan: SweepPlan, name: str, warmup: list, bench, deadline: float | None
) -> None:
    """One mode: build, warm up (every temperature, unrecorded), then every run of the plan."""
    MODES, engine_error = bench.MODES, bench.engine_error  # noqa: N806

    args, report = run.args, run.report
    t0 = time.perf_counter()
    try:
        llm = build_engine(bench.mode_config(args, name), "async")
    except Exception as exc:  # noqa: BLE001 - a mode that cannot start is a result
        report["sweep_engines"][name] = error_record(exc)
        progress(SCRIPT, f"sweep {name}", {"error": str(exc)})
        return
    counters = ProcessCounters(llm.core.device)
    try:
        core = llm.core
        report["sweep_engines"][name] = {
            **dataclasses.asdict(MODES[name]), "build_s": time.perf_counter() - t0,
            "engine": engine_info(llm), "vocab_guard": bench.guard_draft_vocab(core),
            "stand_in_drafts": bench.stand_in_drafts(core, name),
        }  # fmt: skip
        recorder = attach_recorder(llm, bench.LoadRecorder())
        spec_on = core.spec.enabled
        base = counters.begin()
        warm(llm.loop, llm.engine, warmup, plan.temperatures)
        report["sweep_engines"][name]["warmup_process"] = counters.since(base)
        logged = args.ttft_anatomy or args.itl_anatomy
        steps = StepLog().attach(llm.engine.dispatcher, llm.loop) if logged else None
        for rate, profile, temp in plan.runs():
            if out_of_time(run, deadline, plan.run_estimate_s(rate), (rate, profile, temp, name)):
                continue
            core.kv.reset_prefix_cache()  # a replayed trace must not hit the last run's cache
            bench.reset_population(core, name)
            recorder.reset()
            if steps is not None:
                steps.reset()
            preemptions, compiles = core.scheduler.num_preemptions, core.compiles.seen
            disp = llm.engine.dispatcher
            ahead = (disp.num_ahead_steps, disp.num_ahead_held, disp.deltas.num_ahead)
            snapshot = None
            if MODES[name].controller:  # counters of this run only (the engine serves them all)
                snapshot = run_view(llm.engine.policy_snapshot, llm.engine.policy_snapshot())
            base = counters.begin()
            try:
                res = llm.loop.run_until_complete(run_trace(
                    llm.engine, plan, rate, profile, temp, send_alpha=spec_on,
                    snapshot=snapshot, snapshot_every=args.snapshot_interval,
                ))  # fmt: skip
                row = summary_row(
                    res,
                    plan,
                    rate,
                    profile,
                    temp,
                    name,
                    **spec_columns(recorder),
                    engine_error=engine_error(llm.engine),
                    num_preemptions=core.scheduler.num_preemptions - preemptions,
                    # Triton compiles under this run's traffic (each a stall of every lane)
                    num_kernel_compiles=core.compiles.seen - compiles,
                    num_decode_rows_fused=recorder.num_rows_fused,  # fuse_decode_backlog_s
                    num_ahead_steps=disp.num_ahead_steps - ahead[0],
                    num_ahead_held=disp.num_ahead_held - ahead[1],  # for a landing prompt
                    # deltas handed out ahead of a drafting launch (deliver_before_drafting)
                    num_deltas_ahead=disp.deltas.num_ahead - ahead[2],
                    process=counters.since(base),  # device memory calls, collections
                )
                if args.ttft_anatomy:
                    row["ttft_anatomy"] = anatomy(steps, res["traces"])
                if args.itl_anatomy:
                    row["itl_anatomy"] = itl_anatomy(steps, res["traces"])
            except Exception as exc:  # noqa: BLE001 - record and go on
                res, row = {"samples": []}, {"rate": rate, "acceptance_profile": profile,
                                             "temperature": temp, "mode": name,
                                             **error_record(exc)}  # fmt: skip
            record_run(run, row, res["samples"])
        if steps is not None:
            steps.close()
    finally:
        counters.close()
        close_engine(llm)


def throwaway_engine(run, plan: SweepPlan, name: str, warmup: list, bench) -> None:
    """Builds mode ``name``'s engine, warms it up, serves the plan's burn-in and closes it, all
    unrecorded (``--throwaway-engine``): the measured engines come after it."""
    t0 = time.perf_counter()
    try:
        llm = build_engine(bench.mode_config(run.args, name), "async")
    except Exception as exc:  # noqa: BLE001 - the measured build of this mode reports it
        run.report["throwaway_engine"] = {"mode": name, **error_record(exc)}
        return
    counters = ProcessCounters(llm.core.device)
    try:
        base = counters.begin()
        warm(llm.loop, llm.engine, warmup, plan.temperatures)
        llm.loop.run_until_complete(burn_in(llm.engine, plan, send_alpha=llm.core.spec.enabled))
        run.report["throwaway_engine"] = {"mode": name, "seconds": time.perf_counter() - t0,
                                          "burn_in_s": plan.burn_in_s,
                                          "process": counters.since(base)}  # fmt: skip
    finally:
        counters.close()
        close_engine(llm)


def out_of_time(run, deadline: float | None, estimate_s: float, key: tuple) -> bool:
    """--max-wall-s: a run whose estimate would end past the deadline is skipped (and listed
    under ``skipped``; the criteria then judge what ran). ``key``: (rate, profile, T, mode)."""
    if deadline is None or time.perf_counter() + estimate_s <= deadline:
        return False
    names = ("rate", "acceptance_profile", "temperature", "mode")
    run.report["skipped"].append(dict(zip(names, key, strict=True)))
    progress(SCRIPT, f"sweep {key}", {"error": "skipped: out of --max-wall-s"})
    return True


def warm(loop, engine, warmup: list, temperatures) -> None:
    """Unrecorded warm-up requests at every temperature of the plan (kernels, graphs)."""
    for temp in temperatures:
        params_of = lambda i, r, t=temp: warm_params(r, t, i)  # noqa: E731
        loop.run_until_complete(run_load(engine, warmup, params_of, 120.0))


def warm_params(req, temperature: float, index: int):
    from verifypd.types import SamplingParams

    return SamplingParams(max_tokens=req.max_tokens, temperature=temperature, seed=index,
                          ignore_eos=True)  # fmt: skip


def spec_columns(recorder) -> dict[str, Any]:
    spec = recorder.summary()["spec"] or {}
    return {
        "num_drafted": spec.get("num_drafted", 0),
        "num_accepted": spec.get("num_accepted", 0),
        "acceptance_rate": spec.get("acceptance_rate"),
        "mean_draft_len_decided": recorder.spec_summary()["mean_draft_len_decided"],
    }


def record_run(run, row: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    report = run.report
    report["sweep"].append(row)
    if samples:
        keys = ("rate", "acceptance_profile", "temperature", "mode")
        report["policy_timeline"].append({**{k: row[k] for k in keys}, **columnar(samples)})
    what = f"sweep {row['mode']} {row['acceptance_profile']} T={row['temperature']} {row['rate']}/s"
    # Triton compiles under the run's traffic (in-process, or the server's counter): shown
    # only when there were some, each a stall of every lane.
    compiles = row_count(row, "kernel_compiles")
    keys = ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms", "goodput_rps", "kernel_compiles")
    progress(SCRIPT, what, {**row, "kernel_compiles": compiles or None}, keys)
    run.save()


# The snapshot's counters that accumulate over an engine's life (one engine serves every run
# of its mode in a sweep): ``since`` reports them per run.
RUN_COUNTERS = ("decisions", "drafter_", "num_steps", "num_fused", "num_grow", "num_shrink",
                "num_probes")  # fmt: skip
# Running means (cadence_*_s: since the engine started), not per run: left out of a run's view.
LIFE_MEANS = ("cadence_spec_s", "cadence_spec_predicted_s", "cadence_plain_s",
              "cadence_plain_predicted_s")  # fmt: skip


def since(snap: dict, base: dict) -> dict:
    """``snap`` (a policy snapshot) with its counters (``RUN_COUNTERS`` prefixes and the
    cadence step counts) counted from ``base``, a snapshot taken when the run started, and the
    engine-life means left out (the fused share is the run's); the rest (levels, estimates,
    last decision) as it is now."""
    out = {}
    for key, value in snap.items():
        if key in LIFE_MEANS:
            continue
        before = base.get(key)
        if key.startswith(RUN_COUNTERS) or key.endswith("_steps"):
            if isinstance(value, dict) and isinstance(before, dict):  # ``decisions``
                value = {k: v - before.get(k, 0) for k, v in value.items()}
            elif isinstance(value, int) and isinstance(before, int):
                value -= before
        out[key] = value
    if "fused_fraction" in out and "num_fused" in out:  # the run's, not the engine life's
        steps = out.get("num_steps")
        out["fused_fraction"] = out["num_fused"] / steps if steps else None
    return out


def run_view(snapshot: Callable[[], dict], base: dict) -> Callable[[], dict]:
    """``snapshot`` (``AsyncEngine.policy_snapshot``) as one run sees it: ``since(base)``."""
    return lambda: since(snapshot(), base)
