"""A burst of prompts beside running decodes (issue 14's TTFT tail at 14 req/s), through
``AsyncEngine`` as the server runs it: how fast the lanes compute a burst with no decode rows,
and beside ``--decode-rows`` requests decoding. Per run: the burst's span (submission to its
last first token), that span per 1k prompt tokens, each prompt's TTFT, and the decode rows'
tokens and longest gap during the burst. Runs alternate with and without decode rows.

    python bench/burst.py --decode-rows 32 --prompts 1628 1846 152 2803 1750 1082
    python bench/burst.py --engine-option prefill_slice_layers=0   # any EngineConfig field
    python bench/burst.py --http http://127.0.0.1:8000 --vocab 32000  # through a server
    python bench/burst.py --compare A.json B.json ... --out PNG    # runs side by side

``--http`` sends the same requests to a running OpenAI server (streaming ``/v1/completions``
with token-id prompts, ``bench/http_load.py``): the burst as its clients see it, the server's
front and event loop included, to set beside the in-process runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import add_common_args, format_table, median, save_figure, start_run  # noqa: E402
from gpu_gaps import annotated, format_gaps, kernel_gaps, load_trace  # noqa: E402
from http_load import HttpEngine, served_model, server_info  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.engine.pending import PendingStep  # noqa: E402
from verifypd.engine.runner import ModelRunner  # noqa: E402
from verifypd.engine.scheduler import Scheduler  # noqa: E402
from verifypd.lanes.async_engine import AsyncEngine  # noqa: E402
from verifypd.lanes.deltas import Deltas  # noqa: E402
from verifypd.lanes.dispatcher import LaneDispatcher  # noqa: E402
from verifypd.model_config import dummy_preset  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402

# The 14 req/s trace's burst (SweepPlan.requests(14), req-35..43, long prompts) that makes
# the TTFT p99 against vLLM (docs/performance.md).
BURST = (1628, 1846, 152, 2803, 1750, 1082)
# The host's parts of a step, annotated in a traced burst (--trace): fold-back, planning,
# input upload, each piece of a prompt step's launch, the wait for a result, the deltas.
HOST_STEPS = (
    (LaneDispatcher, "collect"), (LaneDispatcher, "_plan"), (Scheduler, "plan_prefill"),
    (Scheduler, "begin_step"), (ModelRunner, "prepare"), (EngineCore, "launch_iter"),
    (EngineCore, "launch"), (EngineCore, "apply_step"), (PendingStep, "result"),
    (Deltas, "emit"),
)  # fmt: skip
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--prompts", type=int, nargs="+", default=list(BURST), help="prompt tokens")
    p.add_argument("--decode-rows", type=int, default=32, help="requests decoding beside it")
    p.add_argument("--decode-context", type=int, default=256, help="their prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=3000, help="their max_tokens (a bound)")
    p.add_argument("--repeats", type=int, default=3, help="runs with and without decode rows")
    p.add_argument("--num-kv-blocks", type=int, default=16384)
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: the host's steps annotated, each profiled burst's Chrome "
                        "trace written to DIR (gzipped) and its GPU idle gaps summarised "
                        "(bench/gpu_gaps.py)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="after the runs, one more burst each way under the torch profiler: "
                        "GPU time by kernel name (the top 15)")  # fmt: skip
    p.add_argument("--engine-option", action="append", default=[], metavar="FIELD=VALUE",
                   help="an EngineConfig field (VALUE as JSON, else a string)")  # fmt: skip
    p.add_argument("--http", default=None, metavar="URL",
                   help="drive the OpenAI server at URL instead of an in-process engine (the "
                        "server's own settings apply)")  # fmt: skip
    p.add_argument("--vocab", type=int, default=None,
                   help="prompt ids lie below it (default: the engine's vocabulary; over HTTP, "
                        "the served dummy preset's)")  # fmt: skip
    args = p.parse_args(argv)
    if args.http and (args.profile or args.engine_option):
        p.error("--http: --profile and --engine-option apply to an in-process engine only")
    if args.trace and not args.profile:
        p.error("--trace needs --profile")
    return args


def engine_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        field, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-option wants FIELD=VALUE, got {pair!r}")
        try:
            out[field] = json.loads(text)
        except json.JSONDecodeError:
            out[field] = text
    return out


Engine = AsyncEngine | HttpEngine  # generate(request_id, prompt_ids, params): deltas


async def decoder(
    engine: Engine, rid: str, prompt: list[int], max_tokens: int, times: list[float]
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(rid, prompt, params):
        times.extend([time.perf_counter()] * len(out.new_token_ids))


async def first_token(engine: Engine, rid: str, prompt: list[int]) -> float:
    """When the request's first token arrived; its stream is read to its end (over HTTP a
    stream left open holds its connection)."""
    first = None
    async for out in engine.generate(rid, prompt, FIRST):
        if first is None and out.new_token_ids:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{rid} ended without a token")
    return first


async def one_burst(
    engine: Engine, args: argparse.Namespace, rows: int, run: int, mark: bool = False
) -> dict:
    """Decoders first (each past its third token), then the burst at once; the decoders are
    dropped (aborted; over HTTP, disconnected) once every prompt has its first token.
    ``mark``: the burst is a ``record_function`` range named "burst" (a profiled run)."""
    rng = np.random.default_rng([args.seed, run + 1, rows])  # the warm-up is run -1
    vocab = args.vocab

    def prompt(n: int) -> list[int]:  # unique: no prefix-cache hits across runs
        return rng.integers(100, vocab - 100, n).tolist()

    times: list[list[float]] = [[] for _ in range(rows)]
    decoders = [asyncio.create_task(decoder(engine, f"d{run}-{rows}-{i}",
                                            prompt(args.decode_context), args.decode_tokens,
                                            times[i]))
                for i in range(rows)]  # fmt: skip
    while any(len(t) < 3 for t in times):
        for task in decoders:
            if task.done():  # refused or failed: its error, not a wait for ever
                task.result()
                raise RuntimeError("a decode row ended before the burst")
        await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    with torch.profiler.record_function("burst") if mark else contextlib.nullcontext():
        firsts = await asyncio.gather(*(first_token(engine, f"b{run}-{rows}-{i}", prompt(n))
                                        for i, n in enumerate(args.prompts)))  # fmt: skip
    t1 = max(firsts)
    for task in decoders:
        task.cancel()
    await asyncio.gather(*decoders, return_exceptions=True)
    inside = [[x for x in t if t0 <= x <= t1] for t in times]
    gaps = [b - a for t in times for a, b in zip(t, t[1:], strict=False) if t0 <= b <= t1]
    tokens = sum(args.prompts)
    return {
        "decode_rows": rows,
        "run": run,
        "span_ms": (t1 - t0) * 1e3,
        "ms_per_1k_prompt_tokens": (t1 - t0) * 1e6 / tokens,
        "ttft_ms": [(f - t0) * 1e3 for f in firsts],
        "decode_tokens_in_burst": sum(len(x) for x in inside),
        "decode_gap_max_ms": max(gaps) * 1e3 if gaps else None,
    }


async def measure(args: argparse.Namespace, config: EngineConfig) -> list[dict]:
    engine = AsyncEngine(config)
    await engine.start()
    args.vocab = args.vocab or engine.vocab_size
    try:
        out = await bursts(engine, args)
        if args.profile:
            for rows in (0, args.decode_rows):
                out.append(await profiled_burst(engine, args, rows))
        return out
    finally:
        await engine.stop()


async def measure_http(args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    """The runs against the server at ``args.http``, and its settings (``/server_info``)."""
    info = await server_info(args.http)
    if args.vocab is None:
        name = str(((info or {}).get("engine_config") or {}).get("model", ""))
        preset = dummy_preset(name)
        if preset is None:
            raise SystemExit(f"--http: the server's model {name or '?'} is not a dummy preset: "
                             "pass --vocab")  # fmt: skip
        args.vocab = preset.vocab_size
    model = await served_model(args.http)
    async with HttpEngine(args.http, model, {"return_token_ids": True}) as engine:
        return await bursts(engine, args), info


async def bursts(engine: Engine, args: argparse.Namespace) -> list[dict]:
    """A warm-up burst (not kept), then ``args.repeats`` runs without and with decode rows."""
    await one_burst(engine, args, args.decode_rows, -1)
    out = []
    for run in range(args.repeats):
        for rows in (0, args.decode_rows):
            out.append(await one_burst(engine, args, rows, run))
            print(f"run {run} rows {rows}: {out[-1]['span_ms']:.1f} ms", flush=True)
    return out


async def profiled_burst(engine: AsyncEngine, args: argparse.Namespace, rows: int) -> dict:
    """``one_burst`` under the torch profiler: the kernels' GPU time summed by name over the
    whole run, decoders' ramp included (on CPU: none)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if args.trace:
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof, annotated(HOST_STEPS if args.trace else ()):
        result = await one_burst(engine, args, rows, 1000, mark=bool(args.trace))
    if args.trace:
        result.update(trace_gaps(prof, Path(args.trace), rows, gaps=cuda))
    totals: dict[str, float] = {}
    ranges = {"burst"} | {f"{owner.__name__}.{name}" for owner, name in HOST_STEPS}
    for e in prof.events():  # (the host's ranges have a GPU-side copy: not kernels)
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in ranges:
            span = (e.time_range.end - e.time_range.start) / 1e3
            totals[e.name] = totals.get(e.name, 0.0) + span
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    result["profiled"] = True
    result["kernels_ms"] = [{"name": name[:120], "ms": ms} for name, ms in top]
    result["kernels_total_ms"] = sum(totals.values())
    return result


def trace_gaps(prof: Any, out_dir: Path, rows: int, gaps: bool = True) -> dict:
    """Writes the profiled burst's Chrome trace (gzipped) and, with ``gaps``, its GPU idle
    gaps within the burst (``gpu_gaps.kernel_gaps``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"burst-trace-{rows}-rows.json"
    prof.export_chrome_trace(str(raw))
    trace = load_trace(raw)
    path = raw.with_suffix(".json.gz")
    path.write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    if not gaps:
        return {"trace": path.name}
    burst = [e for e in trace["traceEvents"] if e.get("name") == "burst" and "dur" in e]
    window = (burst[0]["ts"], burst[0]["ts"] + burst[0]["dur"]) if burst else None
    summary = kernel_gaps(trace, window=window)
    print(f"\n{rows} decode rows, {path.name}:\n{format_gaps(summary)}")
    return {"trace": path.name, "gpu_gaps": summary}


def compare(paths: list[str], png: str) -> Path:
    """One bar chart of several result files: each file's median burst span with and without
    decode rows, labelled by its tag (the file name after the device) and commit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(paths) + 2, 4))
    for i, path in enumerate(paths):
        data = json.loads(Path(path).read_text())
        for j, (rows, s) in enumerate(
            sorted(data["results"]["summary"].items(), key=lambda kv: int(kv[0]))
        ):
            bar = ax.bar(i + 0.4 * j - 0.2, s["span_ms"], 0.38, color=f"C{j}",
                         label=f"{rows} decode rows" if i == 0 else None)  # fmt: skip
            ax.bar_label(bar, fmt="%.0f", fontsize=7)
    labels = [Path(p).stem.split("-", 3)[-1] for p in paths]
    ax.set_xticks(range(len(paths)), labels, rotation=20, fontsize=7)
    ax.set(ylabel="burst span, ms (submission to the last first token)",
           title="a burst's prompts with and without decode rows beside them")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = save_figure(fig, Path(png), dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--compare":
        files, out = argv[1 : argv.index("--out")], argv[argv.index("--out") + 1]
        print("wrote", compare(files, out))
        return
    run = start_run("burst", argv, parse_args, method="AsyncEngine (or, with --http, an OpenAI "
                    "server), no speculation unless the server has it; a burst submitted at once "
                    "beside decode rows that have each had 3 tokens")  # fmt: skip
    args = run.args
    options = engine_options(args.engine_option)
    if args.http:
        runs, info = asyncio.run(measure_http(args))
        run.report["results"] = {"http": args.http, "server_info": info}
    else:
        config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
            scheduler=SchedulerConfig(max_model_len=args.max_model_len or None),
            cache=CacheConfig(num_blocks=args.num_kv_blocks), **options,
        )  # fmt: skip
        runs = asyncio.run(measure(args, config))
        run.report["results"] = {}
    summary = {}
    keys = ("span_ms", "ms_per_1k_prompt_tokens", "decode_tokens_in_burst")
    for rows in sorted({r["decode_rows"] for r in runs}):
        mine = [r for r in runs if r["decode_rows"] == rows and not r.get("profiled")]
        summary[str(rows)] = {k: median([r[k] for r in mine]) for k in keys}
    run.report["results"].update(engine_options=options, vocab=args.vocab, runs=runs,
                                 summary=summary)  # fmt: skip
    table = format_table(
        ["decode rows", "burst span ms", "ms / 1k prompt tokens", "decode tokens in it"],
        [[rows, f"{s['span_ms']:.1f}", f"{s['ms_per_1k_prompt_tokens']:.2f}",
          f"{s['decode_tokens_in_burst']:.0f}"] for rows, s in summary.items()],
    )  # fmt: skip
    for r in runs:
        if r.get("profiled"):
            print(f"\nprofiled, {r['decode_rows']} decode rows: span {r['span_ms']:.1f} ms, "
                  f"kernels {r['kernels_total_ms']:.1f} ms")  # fmt: skip
            for k in r["kernels_ms"]:
                print(f"  {k['ms']:8.2f} ms  {k['name'][:90]}")
    run.finish(table)


if __name__ == "__main__":
    main()
