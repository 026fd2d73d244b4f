"""Mixed-traffic tail latency with speculative decoding on: three lanes + controller against the
single-lane fused baseline (``lane_mode="single"``, the vLLM-like design), same engine, same GPU,
same run, same requests.

``AsyncEngine`` is driven in-process (no HTTP) by an open-loop Poisson arrival process (seeded):
short chat-like requests (prompt 64-256, output 64-256 tokens) mixed with long-prompt requests
(prompt 1024-3072, output 32-128) at --long-fraction, --rate requests/s, for --num-requests
requests (or --duration seconds). Greedy, EOS ignored, random prompt ids. Target
dummy:qwen2.5-7b, drafter dummy:qwen2.5-0.5b. Per request: TTFT (arrival -> first token), ITL
(gap between successive deltas / tokens in the delta, one sample per token), TPOT, e2e.

SYNTHETIC ACCEPTANCE: dummy weights accept almost nothing, so the accepted count of every verify
is drawn from a truncated geometric with alpha = --acceptance for every request; with --sweep
each request carries its profile's alpha (``SamplingParams.synthetic_acceptance``). The draft
and verify forwards are real.

--sweep (issue 14; bench/mixed_sweep.py, bench/sweep.py, bench/sweep_criteria.py,
bench/sweep_report.py, told in docs/performance.md "The rate sweep"): --rates x --profiles x
--temperatures against each of --modes (default off, single-fixed, three-fixed, policy), each
engine built once, the same KV pool (--num-kv-blocks) and traces in every mode; --http URL
replays the same traces against a running OpenAI server instead.

Modes (--modes): three-ctrl (three lanes + controller, L_max = --draft-len), three-fixed (three
lanes, fixed L), single-fixed (fused single lane, fixed L), three-off (three lanes, no
speculation); also single-ctrl, single-off, and three-fixed-unchained / three-ctrl-unchained
(drafting not chained behind each verify: ``SpecConfig.chain_drafts`` off, for A/B runs);
the sweep's variants (``MODES``, bench/mixed_modes.py), among them off-noahead /
policy-noahead (decode-ahead off).

What a mode's run records and the table and plot of the modes: bench/mixed_report.py.

    python bench/mixed.py
    python bench/mixed.py --device cpu --model dummy:tiny --draft-model dummy:tiny \
        --num-requests 6 --rate 20 --short-prompt-len 8 16 --short-output-len 4 8 \
        --long-prompt-len 48 64 --long-output-len 2 4 --warmup-requests 1 --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import (  # noqa: E402
    add_common_args,
    add_spec_args,
    csv_list,
    error_record,
    format_table,
    progress,
    release_memory,
    start_run,
)
from harness import (  # noqa: E402
    CompileLog,
    attach_recorder,
    build_engine,
    close_engine,
    engine_config,
    engine_info,
    synthetic_note,
    synthetic_spec,
)
from loadgen import (  # noqa: E402
    Mix,
    Request,
    Trace,
    make_requests,
    run_load,
)
from mixed_modes import DEFAULT_MODES, MODES, SWEEP_MODES  # noqa: E402
from mixed_report import (  # noqa: E402
    HEADERS,
    LoadRecorder,
    mode_results,
    plot,
    progress_view,
    summary_rows,
)
from mixed_sweep import add_sweep_args, run_sweep  # noqa: E402

from verifypd.config import EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from verifypd.controller import AcceptanceEstimate  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402

SCRIPT = "mixed"


SNAPSHOT_KEYS = ("num_requests", "mean_draft_len", "mean_acceptance", "p95_decode_s",
                 "verify_queue_depth", "pressure")  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_spec_args(p, acceptance=0.7)
    p.add_argument(
        "--modes",
        type=csv_list,
        default=None,
        help=f"{','.join(MODES)} (default {DEFAULT_MODES}; --sweep: {SWEEP_MODES}); NAME~2: "
        "NAME's configuration once more under its own label",
    )
    add_sweep_args(p)
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--duration", type=float, default=0.0, help="arrivals stop here; 0 = off")
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals, requests/s")
    p.add_argument("--long-fraction", type=float, default=0.2, help="share of long prompts")
    p.add_argument("--short-prompt-len", type=int, nargs=2, default=[64, 256])
    p.add_argument("--short-output-len", type=int, nargs=2, default=[64, 256])
    p.add_argument("--long-prompt-len", type=int, nargs=2, default=[1024, 3072])
    p.add_argument("--long-output-len", type=int, nargs=2, default=[32, 128])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-prefill-chunk", type=int, default=SchedulerConfig.max_prefill_chunk)
    p.add_argument("--ttft-budget-s", type=float, default=0.5)
    p.add_argument("--num-kv-blocks", type=int, default=0, help="0 = the engine sizes it")
    p.add_argument("--warmup-requests", type=int, default=8, help="unrecorded, per mode")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="s after the last arrival")
    p.add_argument("--snapshot-interval", type=float, default=0.25, help="controller sampling s")
    add_common_args(p)
    args = p.parse_args(argv)
    args.modes = args.modes or (SWEEP_MODES if args.sweep else DEFAULT_MODES)
    if args.sweep:
        args.tag = args.tag or "sweep"
        if not (args.num_kv_blocks or args.http):
            p.error("--sweep needs --num-kv-blocks (the same KV pool in every mode)")
    if any(m not in MODES for m in args.modes):
        p.error(f"--modes: choose from {list(MODES)} (NAME~2: NAME once more, its own label)")
    longest = max(args.short_prompt_len[1] + args.short_output_len[1],
                  args.long_prompt_len[1] + args.long_output_len[1])  # fmt: skip
    if args.max_model_len and longest > args.max_model_len:
        p.error(f"prompt + output up to {longest} tokens > --max-model-len {args.max_model_len}")
    return args


# ----------------------------------------------------------------------------- load
def sampling_params(args, req: Request, index: int) -> SamplingParams:
    # A fixed seed per request: the synthetic acceptance draws are the same in every mode.
    seed = args.seed * 1_000_003 + index
    # Ids only (no detokenizing), as vLLM's replay of the same trace (skip_tokenizer_init).
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=args.temperature, seed=seed, ignore_eos=True,
        detokenize=False,
    )  # fmt: skip


async def sample_controller(core, out: list[dict[str, Any]], interval: float) -> None:
    """Snapshots of the controller while requests are live (its means are over live ones)."""
    while True:
        snap = core.controller.snapshot()
        if snap["num_requests"]:
            out.append({k: snap[k] for k in SNAPSHOT_KEYS})
        await asyncio.sleep(interval)


async def drive(engine, requests: list[Request], args) -> tuple[list[Trace], list, float]:
    """``run_load`` with the controller sampled alongside (speculating modes)."""
    snaps: list[dict[str, Any]] = []
    sampler = None
    if engine.core.spec.enabled:
        sampler = asyncio.create_task(sample_controller(engine.core, snaps, args.snapshot_interval))
    try:
        params_of = lambda i, req: sampling_params(args, req, i)  # noqa: E731
        traces, t_start = await run_load(engine, requests, params_of, args.drain_timeout)
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    return traces, snaps, t_start


def mix_of(args) -> Mix:
    lens = (args.short_prompt_len, args.short_output_len, args.long_prompt_len,
            args.long_output_len)  # fmt: skip
    return Mix(*(tuple(x) for x in lens), args.long_fraction)


# ----------------------------------------------------------------------------- one mode
def mode_config(args, name: str) -> EngineConfig:
    mode = MODES[name]
    spec = SpecConfig(method="off")
    if mode.speculate:
        spec = synthetic_spec(args, mode.controller, mode.chain_drafts)
        if mode.policy is not None:
            spec = dataclasses.replace(spec, policy=mode.policy)
        spec = dataclasses.replace(spec, **dict(mode.spec_options))
    cfg = engine_config(
        args.model, args.device, args.dtype, args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_blocks=args.num_kv_blocks or None,
        spec=spec,
        lane_mode=mode.lane_mode,
    )  # fmt: skip
    sched_options = {"max_prefill_chunk": args.max_prefill_chunk,
                     "ttft_budget_s": args.ttft_budget_s, **dict(mode.sched_options)}  # fmt: skip
    sched = dataclasses.replace(cfg.scheduler, **sched_options)
    return cfg.replace(scheduler=sched, **dict(mode.engine_options))


def reset_population(core, name: str) -> None:
    """Before each measured run: the population α of a mode that sets ``population_prior``
    (as the goodput policy starts it: the prior counts as ``population_prior_count`` verifies)."""
    prior = MODES[name].population_prior
    policy = core.controller
    if prior is not None and hasattr(policy, "population"):
        g = policy.goodput
        policy.population = AcceptanceEstimate(g.population_weight, prior,
                                               g.population_prior_count)  # fmt: skip


def guard_draft_vocab(core) -> dict[str, Any] | None:
    """dummy:qwen2.5-7b has 128 more (padding) ids than its 0.5B drafter, and random target
    weights do emit them; the drafter's embedding would index out of range. Benchmark-side
    guard: clamp the drafter's input ids (drafting runs eager, so a pre-hook sees every call)."""
    drafter = core.spec.drafter
    if drafter is None or drafter.vocab_size >= core.model_config.vocab_size:
        return None
    top = drafter.vocab_size - 1
    drafter.runner.model.embed_tokens.register_forward_pre_hook(
        lambda _m, inputs: (inputs[0].clamp(max=top), *inputs[1:])
    )
    return {
        "draft_vocab": drafter.vocab_size,
        "target_vocab": core.model_config.vocab_size,
        "note": "drafter input ids clamped to its vocab (bench-side forward pre-hook)",
    }


def stand_in_drafts(core, name: str) -> dict[str, Any] | None:
    """A mode with ``Mode.stand_in_drafts``: its prompt lookup always drafts L copies of the
    last token (host only, nothing on the GPU); the synthetic α decides how many are kept."""
    if not MODES[name].stand_in_drafts:
        return None
    if core.spec.ngram is None:
        raise ValueError(f"mode {name}: stand-in drafts need SpecConfig.method 'ngram'")
    core.spec.ngram.propose = lambda _seq_id, tokens, k: [tokens[-1]] * k
    return {"note": "prompt lookup replaced by L copies of the last token (bench-side)"}


def run_mode(args, name: str, requests: list[Request], warmup: list[Request]) -> dict[str, Any]:
    t = time.perf_counter()
    llm = build_engine(mode_config(args, name), "async")
    try:
        rec: dict[str, Any] = {"mode": name, **dataclasses.asdict(MODES[name])}
        rec["build_s"] = time.perf_counter() - t
        rec["engine"] = engine_info(llm)
        rec["scheduler"] = dataclasses.asdict(llm.core.config.scheduler)
        rec["vocab_guard"] = guard_draft_vocab(llm.core)
        rec["stand_in_drafts"] = stand_in_drafts(llm.core, name)
        recorder = attach_recorder(llm, LoadRecorder())
        if llm.core.spec.enabled:
            recorder.time_proposals(llm.engine.policy)
        compiles = CompileLog()
        compiles.install()
        t = time.perf_counter()
        llm.loop.run_until_complete(drive(llm.engine, warmup, args))
        rec["warmup_s"] = time.perf_counter() - t
        recorder.reset()
        compiles.reset()
        preemptions = llm.core.scheduler.num_preemptions
        traces, snaps, t_start = llm.loop.run_until_complete(drive(llm.engine, requests, args))
        rec["run_s"] = time.perf_counter() - t_start
        rec["num_preemptions"] = llm.core.scheduler.num_preemptions - preemptions
        rec["engine_error"] = engine_error(llm.engine)
        rec["compiles_during_run"] = compiles.summary()
        return rec | mode_results(llm, recorder, traces, snaps, t_start)
    finally:
        close_engine(llm)


def engine_error(engine) -> str | None:
    """The engine loop's exception, if it died (its requests then show up as unfinished)."""
    task = getattr(engine, "_task", None)
    if task is None or not task.done() or task.cancelled() or task.exception() is None:
        return None
    return repr(task.exception())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args, METHOD)
    args, report = run.args, run.report
    vocab = prompt_vocab(args)
    mix = mix_of(args)
    warmup = make_requests(mix, vocab, args.seed + 1, args.warmup_requests, None, prefix="warm")
    for i, w in enumerate(warmup):
        w.max_tokens = min(w.max_tokens, 16)
        if i % 2 == 0:  # Triton specializes ints divisible by 16: compile those variants now
            w.prompt = w.prompt[: max(16, len(w.prompt) // 16 * 16)]
    if args.sweep:
        report["synthetic_acceptance"] = synthetic_note(args, per_request=True)
        return run_sweep(run, mix, vocab, warmup, sys.modules[__name__])
    report["synthetic_acceptance"] = synthetic_note(args, per_request=False)  # one alpha for all
    requests = make_requests(mix, vocab, args.seed, args.num_requests, args.rate, args.duration)
    report["workload"] = workload_summary(requests)
    itl: dict[str, list[float]] = {}
    for name in args.modes:  # saved after every mode: a killed run keeps what it measured
        try:
            r = run_mode(args, name, requests, warmup)
            itl[name] = r.pop("_itl")
        except Exception as exc:  # noqa: BLE001 - record and go on
            r = {"mode": name, **dataclasses.asdict(MODES[name]), **error_record(exc)}
        release_memory()
        report["results"][name] = r
        progress(SCRIPT, name, progress_view(r), ("ttft_p99_ms", "itl_p99_ms"))
        run.save()
    table = format_table(HEADERS, summary_rows(report["results"]))
    table += (f"\nms; synthetic acceptance alpha={args.acceptance} for every request; fixed L = "
              f"controller L_max = {args.draft_len}; {len(requests)} requests at {args.rate}/s, "
              f"{args.long_fraction:.0%} long")  # fmt: skip
    run.finish(table, lambda png: plot(png, report["results"], itl))
    return report


def prompt_vocab(args) -> int:
    """Prompt ids the target takes and the drafter's embedding reads (it reads the prompt too;
    an EAGLE-3-shaped drafter reads more ids than it scores)."""
    from verifypd.config import PRESETS

    target, drafter = (
        PRESETS.get(m.removeprefix("dummy:")) for m in (args.model, args.draft_model)
    )
    vocabs = [c for c in (target and target.vocab_size, drafter and drafter.embed_vocab_size) if c]
    return min(vocabs) if vocabs else 32000


def workload_summary(requests: list[Request]) -> dict[str, Any]:
    kinds = Counter(r.kind for r in requests)
    return {
        "num_requests": len(requests),
        "by_kind": dict(kinds),
        "arrival_span_s": requests[-1].arrival_s if requests else 0.0,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "requested_output_tokens": sum(r.max_tokens for r in requests),
    }


METHOD = (
    "open-loop Poisson arrivals (seeded, identical requests in every mode), AsyncEngine "
    "in-process; TTFT = intended arrival -> first token delta; ITL = gap between successive "
    "deltas / tokens in the delta, one sample per token (token-weighted percentiles); TPOT = "
    "(last - first delta) / (output - 1) per finished request; e2e = arrival -> finish; "
    "throughput over first arrival -> last token; per mode a fresh engine and --warmup-requests "
    "unrecorded requests first (with --throwaway-engine a sweep builds the first mode's engine "
    "once more before them, which serves --burn-in-s of another trace, unrecorded); mean "
    "L = drafts per verify; accept = accepted / drafted"
)


if __name__ == "__main__":
    main()
