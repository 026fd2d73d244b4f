"""The sweeps that drive an engine through a front, not an ``AsyncEngine`` on the load
generator's loop (``mixed.py --sweep``):

- ``--http URL``: an OpenAI server (ours or vLLM's), one client (``http_load``);
- ``--engine-process``: each mode's engine in its own process, the load generator driving a
  ``RemoteEngine`` (``verifypd serve --engine-process``'s engine client, no HTTP).

vLLM's ``AsyncLLM``, which ``peer_vllm.py sweep`` replays the same traces through, runs its
engine core in a background process by default; our in-process rows share one event loop
between the load generator and the engine, whose prompt-step launches hold it (a burst's
arrival then reaches the engine's queue up to ~20 ms late: docs/performance.md). The
``--engine-process`` rows are the like-for-like pair of vLLM's, labelled ``MODE-proc``.

The engine's internals are in the child. Its observer calls cross to the front, which gives
those rows their spec columns, and the policy's timeline is its snapshot asked of the child
(``RemoteEngine.policy_snapshot``) every ``--snapshot-interval``; the step anatomies are
in-process only. The prefix cache is kept apart per run by a ``cache_salt`` per run (the
in-process rows reset the cache instead), and the policy's population estimate is not reset
between runs (as over HTTP).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

import numpy as np
from common import error_record
from http_load import HttpEngine, served_model, server_info, server_means, server_totals
from loadgen import run_load
from mixed_sweep import out_of_time, record_run, since, spec_columns, warm_params
from request_times import client_times, with_engine_times
from sweep import SweepPlan, burn_in, run_trace, summary_row

from verifypd.serve.engine_process import RemoteEngine
from verifypd.types import RequestTiming

LABEL_SUFFIX = "-proc"


class SaltedEngine:
    """``generate`` with every request's ``cache_salt`` set to ``salt``; each request's
    ``RequestTiming`` (the engine's stamps of its first token) kept in ``timings``."""

    def __init__(self, engine: Any, salt: str) -> None:
        self.engine, self.salt = engine, salt
        self.timings: dict[str, RequestTiming] = {}

    def generate(self, request_id: str, prompt_token_ids: list[int], params: Any):
        salted = dataclasses.replace(params, cache_salt=self.salt)
        timing = self.timings[request_id] = RequestTiming()
        return self.engine.generate(request_id, prompt_token_ids, salted, timing=timing)


async def remote_engine_sweep(
    run, plan: SweepPlan, name: str, warmup: list, bench, deadline: float | None
) -> None:
    """One mode through a ``RemoteEngine``: build (its child loads the model), warm up at
    every temperature, then every run of the plan; a mode that cannot start is a result."""
    report, label = run.report, name + LABEL_SUFFIX
    config = bench.mode_config(run.args, name)
    recorder = bench.LoadRecorder()  # the engine's observer calls, replayed in this process
    t0 = time.perf_counter()
    try:
        if bench.MODES[name].stand_in_drafts:  # the proposer is replaced in this process only
            raise ValueError(f"mode {name}: stand-in drafts run in process only")
        engine = RemoteEngine(config, recorder)
    except Exception as exc:  # noqa: BLE001 - a mode that cannot start is a result
        report["sweep_engines"][label] = error_record(exc)
        return
    report["sweep_engines"][label] = {
        **dataclasses.asdict(bench.MODES[name]), "engine_process": True,
        "build_s": time.perf_counter() - t0, "cache_salt_per_run": True,
    }  # fmt: skip
    send_alpha = config.spec.method != "off"
    nonce = secrets.token_hex(8)
    try:
        await engine.start()
        for temp in plan.temperatures:
            await run_load(engine, warmup, lambda i, r, t=temp: warm_params(r, t, i), 120.0)
        for rate, profile, temp in plan.runs():
            if out_of_time(run, deadline, plan.run_estimate_s(rate), (rate, profile, temp, label)):
                continue
            salted = SaltedEngine(engine, f"{nonce}-{rate}-{profile}-{temp}")
            recorder.reset()
            try:
                snapshot = None
                if bench.MODES[name].controller:  # counters of this run only
                    snapshot = run_view(engine, await engine.policy_snapshot())
                res = await run_trace(salted, plan, rate, profile, temp, send_alpha,
                                      snapshot, run.args.snapshot_interval)  # fmt: skip
                row = summary_row(res, plan, rate, profile, temp, label, front="engine-process",
                                  **spec_columns(recorder))  # fmt: skip
                times = client_times(res["traces"], res["t_start"])
                row["request_times"] = with_engine_times(times, salted.timings)
            except Exception as exc:  # noqa: BLE001 - record and go on
                res, row = {"samples": []}, {"rate": rate, "acceptance_profile": profile,
                                             "temperature": temp, "mode": label,
                                             **error_record(exc)}  # fmt: skip
            record_run(run, row, res["samples"])
    finally:
        await engine.stop()


def run_view(engine: RemoteEngine, base: dict) -> Any:
    """The engine process's policy snapshot as one run sees it (``mixed_sweep.since``), a
    coroutine function for ``run_trace``'s sampler."""

    async def view() -> dict:
        return since(await engine.policy_snapshot(), base)

    return view


async def http_sweep(run, plan: SweepPlan, warmup: list, deadline: float | None) -> None:
    """The same traces against the OpenAI server at ``--http``, one client (http_load)."""
    args = run.args
    model = await served_model(args.http)
    nonce = secrets.token_hex(8)  # another sweep against the same server misses too
    run.report["sweep_engines"][args.mode_label] = {
        "http": args.http, "model": model, "send_alpha": args.http_alpha,
        "cache_salt_per_run": args.http_cache_salt,
        "server_info": await server_info(args.http),  # the server's settings, where it says
    }  # fmt: skip
    async with HttpEngine(args.http, model, args.http_extra) as engine:
        for temp in plan.temperatures:  # every X-Request-Id of the sweep is its own
            engine.id_prefix = f"{nonce}-warm-{temp}/"
            await run_load(engine, warmup, lambda i, r, t=temp: warm_params(r, t, i), 120.0)
        engine.id_prefix = f"{nonce}-burn-in/"
        await burn_in(engine, plan, args.http_alpha)
        for rate, profile, temp in plan.runs():
            if out_of_time(
                run, deadline, plan.run_estimate_s(rate), (rate, profile, temp, args.mode_label)
            ):
                continue
            if args.http_cache_salt:
                engine.extra["cache_salt"] = f"{nonce}-{rate}-{profile}-{temp}"
            engine.id_prefix = f"{nonce}-{rate}-{profile}-{temp}/"
            try:
                before = await server_totals(args.http)
                res = await run_trace(engine, plan, rate, profile, temp, args.http_alpha)
                row = summary_row(res, plan, rate, profile, temp, args.mode_label, front="http")
                row["request_times"] = client_times(res["traces"], res["t_start"], engine.id_prefix)
                # The server's own first-token and queue means against the client's: what
                # the HTTP front and the network add.
                ttfts = [t.ttft_s for t in res["traces"] if t.ttft_s is not None]
                row["server"] = {
                    **server_means(before, await server_totals(args.http)),
                    "client_ttft_mean_ms": float(np.mean(ttfts)) * 1e3 if ttfts else None,
                }
            except Exception as exc:  # noqa: BLE001 - record and go on
                row = {"rate": rate, "acceptance_profile": profile, "temperature": temp,
                       "mode": args.mode_label, **error_record(exc)}  # fmt: skip
            record_run(run, row, [])
