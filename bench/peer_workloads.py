"""``peer_vllm.py``'s workloads and their measurement, the same for both engines: decode at a
batch (two output lengths, the step from their difference), the offline batch, and the mixed
trace of ``bench/mixed.py`` at each rate with its latencies and goodput."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from harness import random_prompts
from loadgen import Mix, latency_stats, load_stats, make_requests, run_load
from peer_engines import Batch, greedy

from verifypd.config import PRESETS

MIXES = {
    "default": Mix((64, 256), (64, 256), (1024, 3072), (32, 128), 0.2),  # bench/mixed.py's
    "tiny": Mix((4, 16), (2, 6), (24, 48), (2, 4), 0.2),  # CPU smoke tests
}


def vocab_of(model: str) -> int:
    return PRESETS[model.removeprefix("dummy:")].vocab_size


def decode_prompts(args, batch: int, salt: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed * 7919 + batch * 31 + salt)
    return random_prompts(rng, [args.prompt_len] * batch, vocab_of(args.model))


def offline_workload(args) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed + 17)
    lo, hi = args.offline_lens
    n = args.offline_requests
    in_lens, out_lens = rng.integers(lo, hi + 1, n), rng.integers(lo, hi + 1, n)
    return random_prompts(rng, in_lens, vocab_of(args.model)), [int(x) for x in out_lens]


def mixed_trace(args, rate: float) -> list:
    count = args.mixed_requests
    return make_requests(
        MIXES[args.mix], vocab_of(args.model), args.seed + int(rate * 1000), count, rate
    )


def measure_decode(batch_run: Batch, args, salt: int = 0) -> list[dict[str, Any]]:
    short, long = args.decode_lens
    rows = []
    for b in args.batches:
        batch_run.run(decode_prompts(args, b, salt + 99), [8] * b)  # warm-up at this batch
        times = {short: [], long: []}
        for r in range(args.repeats):
            for n in (short, long):
                secs, got = batch_run.run(decode_prompts(args, b, salt + r * 2 + n), [n] * b)
                if got != b * n:
                    raise RuntimeError(f"batch {b}: expected {b * n} tokens, got {got}")
                times[n].append(secs)
        ts, tl = float(np.median(times[short])), float(np.median(times[long]))
        # Noise can make T(long) <= T(short) on tiny CPU runs: fall back to the end-to-end step.
        fallback = tl <= ts
        step = tl / long if fallback else (tl - ts) / (long - short)
        rows.append({"batch": b, "t_short_s": ts, "t_long_s": tl, "times": times,
                     "step_ms": step * 1e3, "decode_tok_s": b / step,
                     "step_is_e2e_fallback": fallback})  # fmt: skip
    return rows


def measure_offline(run: Any, args) -> dict[str, Any]:
    prompts, out_lens = offline_workload(args)
    warm = [p[:16] for p in prompts[:8]]
    run(warm, [16] * len(warm))  # warm-up
    secs, got = run(prompts, out_lens)
    return {"num_requests": len(prompts), "wall_s": secs, "output_tokens": got,
            "requested_tokens": sum(out_lens), "input_tokens": sum(map(len, prompts)),
            "output_tok_s": got / secs}  # fmt: skip


def measure_mixed(engine: Any, loop: asyncio.AbstractEventLoop, args) -> list[dict[str, Any]]:
    rows = []
    warm = make_requests(
        MIXES[args.mix], vocab_of(args.model), args.seed + 5, 8, None, prefix="warm"
    )
    loop.run_until_complete(run_load(engine, warm, lambda i, r: greedy(r.max_tokens), 120.0))
    for rate in args.rates:
        reqs = mixed_trace(args, rate)
        traces, t0 = loop.run_until_complete(
            run_load(engine, reqs, lambda i, r: greedy(r.max_tokens), args.drain_timeout)
        )
        rows.append({"rate": rate, **mixed_stats(traces, t0, args)})
    return rows


def mixed_stats(traces: list, t_start: float, args) -> dict[str, Any]:
    load = load_stats(traces, t_start)
    ok = [t for t in traces if t.finish_reason in ("length", "stop") and t.ttft_s is not None
          and t.ttft_s * 1e3 <= args.slo_ttft_ms
          and (t.tpot_s is None or t.tpot_s * 1e3 <= args.slo_tpot_ms)]  # fmt: skip
    goodput = len(ok) / load["span_s"] if load["span_s"] else None
    return {"latency": latency_stats(traces), "load": load, "goodput_rps": goodput,
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}}  # fmt: skip
