"""Kernel-level profile of one prompt step (issue 14's TTFT tail): a chunk of --tokens after
--contexts cached tokens, eager as the prefill lane runs chunks longer than
``EngineConfig.prompt_graph_tokens``. Per context: the step's time (alone,
and with --beside-decode B also while a decode step of B rows replays back to back on a
higher-priority stream, as the lanes run them, and then the decode steps' own time), its GPU
time in GEMMs, attention and the rest, and its rate in TFLOP/s (the linear layers' 2 x tokens x
parameters) against the card's bf16 matmul rate measured in the same run. --split-rows: the
same for each ``KernelConfig.gemm_split_rows`` (projections in GEMMs of at most that many rows).

    python bench/profile_prefill.py --model dummy:qwen2.5-7b --tokens 2048 --contexts 0 2048 \\
        --beside-decode 16 --split-rows 0 1024 512
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from common import KERNEL_KINDS as KINDS  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    format_table,
    kernel_kind,
    median,
    release_memory,
    start_run,
    sync,
    timed,
)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig  # noqa: E402
from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.types import NO_SPECULATION, SamplingParams, StepPlan  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--tokens", type=int, default=2048, help="the prompt chunk")
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 2048],
                   help="tokens already in the KV cache before the chunk")  # fmt: skip
    p.add_argument("--beside-decode", type=int, default=0,
                   help="rows of a decode step replayed beside it (GPU; 0 = none)")  # fmt: skip
    p.add_argument("--split-rows", type=int, nargs="+", default=[0],
                   help="KernelConfig.gemm_split_rows, an engine each (0: one GEMM)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args(argv)


def linear_params(core: EngineCore) -> int:
    """Parameters a prompt token multiplies through (the decoder layers' projections)."""
    return sum(p.numel() for n, p in core.loaded.model.layers.named_parameters() if p.dim() == 2)


def _prompt_step(core: EngineCore, rid: str, context: int, tokens: int):
    """A request whose first ``context`` tokens are computed; the plan and inputs of the next
    ``tokens`` (run again and again: it writes the same KV each time)."""
    (seq,) = core.add_request(rid, [100 + i % 20000 for i in range(context + tokens)],
                              SamplingParams(max_tokens=1, temperature=0))  # fmt: skip
    sched = core.scheduler
    if context:
        first = StepPlan("prefill", sched.plan_prefill(context, sched.max_num_seqs))
        sched.begin_step(first)
        core.apply_step(first, core.runner.launch(first).result())  # no token: not its end
    plan = StepPlan("prefill", sched.plan_prefill(tokens, sched.max_num_seqs))
    assert [(e.seq, e.num_new_tokens) for e in plan.seqs] == [(seq, tokens)], "one chunk"
    return plan, core.runner.prepare(plan)


def _decode_replay(core: EngineCore, rows: int):
    """A function that replays a decode step of ``rows`` short sequences (graph or eager)."""
    for i in range(rows):  # its inputs are replayed, never advanced: a few tokens of room do
        core.add_request(f"d{i}", [7 + i, 8, 9, 10], SamplingParams(max_tokens=8))
    sched = core.scheduler
    prefill = StepPlan("prefill", sched.plan_prefill(1 << 16, 1 << 10))
    sched.begin_step(prefill)
    core.apply_step(prefill, core.runner.launch(prefill).result())
    plan = StepPlan("decode", sched.plan_decode(NO_SPECULATION))
    inputs = core.runner.prepare(plan)
    graphs = core.runner.graphs.get(1)
    if graphs is not None and graphs.can_run(inputs.meta, len(plan.seqs)):
        return lambda: graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
    return lambda: core.runner.forward(inputs, inputs.sample_rows)


def profile_step(core, inputs, device) -> dict[str, Any]:
    """GPU (CPU: op) time per kind of one eager forward of the step, and its top kernels."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    sync(device)
    with profile(activities=[activity]) as prof:
        core.runner.forward(inputs, inputs.sample_rows)
        sync(device)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(list)
    spans: list[tuple[float, float]] = []  # GPU kernels' (start, end), microseconds
    for evt in prof.events():
        if device.type == "cuda" and evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type == "cuda":
            spans.append((evt.time_range.start, evt.time_range.end))
        if device.type != "cuda" and (
            evt.cpu_parent is not None or not evt.name.startswith("aten")
        ):
            continue  # CPU: top-level aten ops only (children would count twice)
        ms = (evt.device_time_total if device.type == "cuda" else evt.cpu_time_total) / 1e3
        by_kind[kernel_kind(evt.name)] += ms
        by_name[evt.name[:90]].append(ms)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 if spans else None
    return {
        "ms_by_kind": {k: round(by_kind.get(k, 0.0), 4) for k in KINDS},
        # first kernel's start to last kernel's end: against the kinds' sum, the GPU's idle gaps
        "gpu_span_ms": span,
        "top_kernels": [{"name": n, "count": len(v), "ms": round(sum(v), 4)} for n, v in top],
    }


def time_step(core, inputs, device, repeats: int, beside=None) -> tuple[float, float | None]:
    """Median seconds of the step's forward and, with ``beside`` (a decode replay kept running
    on a higher-priority stream meanwhile, GPU), the decode steps' median milliseconds while
    it ran (None without)."""
    run = lambda: core.runner.forward(inputs, inputs.sample_rows)  # noqa: E731
    if beside is None or device.type != "cuda":
        return median([timed(run, device)[0] for _ in range(repeats)]), None
    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    out, decode = [], []
    for _ in range(repeats):
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(high):
            for _ in range(4):  # decode already running while the prompt step is enqueued
                beside()
        with torch.cuda.stream(low):
            start.record()
            run()
            end.record()
        steps, t0 = 0, time.perf_counter()
        with torch.cuda.stream(high):
            while not end.query():  # decode steps back to back until the prompt step is done
                beside()
                torch.cuda.current_stream().synchronize()
                steps += 1
        decode.append((time.perf_counter() - t0) * 1e3 / max(steps, 1))
        sync(device)
        out.append(start.elapsed_time(end) / 1e3)
    return median(out), median(decode)


def decode_alone_ms(beside, device, repeats: int) -> float | None:
    """Median milliseconds of one replay of the decode step alone (GPU)."""
    if beside is None or device.type != "cuda":
        return None
    return median([timed(beside, device)[0] * 1e3 for _ in range(repeats)])


def profile_engine(args, device, run, split: int) -> list[dict[str, Any]]:
    """One engine with ``gemm_split_rows = split``: a row per context."""
    longest = max(args.contexts) + args.tokens
    blocks = len(args.contexts) * longest // 16 + 64 + args.beside_decode
    sched = SchedulerConfig(max_num_seqs=max(8, args.beside_decode + 1), max_model_len=longest + 16,
                            max_prefill_chunk=longest, max_num_batched_tokens=longest)  # fmt: skip
    core = EngineCore(EngineConfig(model=args.model, device=args.device, scheduler=sched,
                                   cuda_graphs=device.type == "cuda",
                                   kernels=KernelConfig(gemm_split_rows=split),
                                   cache=CacheConfig(num_blocks=blocks)))  # fmt: skip
    flops = 2 * args.tokens * linear_params(core)
    ceiling = run.report["ceilings"].get("bf16_matmul_tflops")
    beside = _decode_replay(core, args.beside_decode) if args.beside_decode else None
    alone_decode = decode_alone_ms(beside, device, args.repeats)
    rows = []
    for i, context in enumerate(args.contexts):
        _, inputs = _prompt_step(core, f"p{i}", context, args.tokens)
        core.runner.forward(inputs, inputs.sample_rows)  # compiled and warm
        alone, _ = time_step(core, inputs, device, args.repeats)
        row = {"split_rows": split, "context": context, "tokens": args.tokens, "seconds": alone,
               "ms_per_1k_tokens": alone * 1e3 / args.tokens * 1e3, "linear_flops": flops,
               "tflops": flops / alone / 1e12, **profile_step(core, inputs, device)}  # fmt: skip
        row["matmul_tflops"] = flops / (row["ms_by_kind"]["matmul"] / 1e3) / 1e12 if (
            row["ms_by_kind"]["matmul"]) else None  # fmt: skip
        row["of_matmul_ceiling"] = row["tflops"] / ceiling if ceiling else None
        if beside is not None and device.type == "cuda":
            both, decode_ms = time_step(core, inputs, device, args.repeats, beside)
            row["seconds_beside_decode"] = both
            row["ms_per_1k_tokens_beside_decode"] = both * 1e6 / args.tokens
            row["decode_step_ms_alone"] = alone_decode
            row["decode_step_ms_beside"] = decode_ms
        rows.append(row)
        core.abort_request(f"p{i}")  # its blocks back for the next context
    del core, beside
    release_memory()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run("profile_prefill", argv, parse_args, "one eager prompt step, profiled")
    args, device = run.args, run.device
    rows: list[dict[str, Any]] = []
    for split in args.split_rows:
        rows += profile_engine(args, device, run, split)
        run.report["results"] = {"linear_flops": rows[0]["linear_flops"], "rows": rows}
        run.save()

    def cells(r: dict[str, Any]) -> list[Any]:
        beside_ms = r.get("ms_per_1k_tokens_beside_decode")
        share = r["of_matmul_ceiling"]
        beside_cell = round(beside_ms, 2) if beside_ms is not None else "-"
        share_cell = round(share, 3) if share else "-"
        decode = r.get("decode_step_ms_beside")
        return [
            r["split_rows"],
            r["context"],
            r["tokens"],
            round(r["ms_per_1k_tokens"], 2),
            beside_cell,
            round(r["tflops"], 1),
            share_cell,
            round(r["seconds"] * 1e3, 2),
            round(r["gpu_span_ms"], 2) if r["gpu_span_ms"] is not None else "-",
            round(decode, 2) if decode is not None else "-",
            *(r["ms_by_kind"][k] for k in KINDS),
        ]

    headers = ["split", "context", "tokens", "ms/1k", "beside decode", "TFLOP/s", "of ceiling",
               "step ms", "kernels span ms", "decode step ms beside", *KINDS]  # fmt: skip
    table = format_table(headers, [cells(r) for r in rows])
    run.finish(table)
    return run.report


if __name__ == "__main__":
    main()
