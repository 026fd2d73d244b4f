"""Diagnostic: where the offline workload's time goes (issue 17), through the lane dispatcher.

Runs the offline workload of ``bench/peer_vllm.py`` (256 requests, input and output lengths
U[100, 1024], all submitted at once, greedy, EOS ignored) twice on the same engine:

1. untraced: the wall time, and the course of the run in 250 ms buckets (output tokens, requests
   that have their first token, requests still running), so the prefill ramp, the full-batch
   middle and the small-batch tail can be told apart;
2. traced: torch profiler windows (CUDA activity only) at chosen offsets into the run. Per window:
   the GPU-busy fraction (union of every kernel and copy on every stream), busy time per stream,
   and kernel time by kind (GEMM, attention, norm/rope/activation, sampling, copies, other).

    python bench/profile_offline.py --model dummy:qwen2.5-7b --windows 0.5:1.5 5:6 11:11.5
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from common import format_table, metadata, result_path, write_json  # noqa: E402
from harness import AsyncLLM  # noqa: E402
from peer_engines import greedy  # noqa: E402
from peer_vllm import parse_args as peer_args  # noqa: E402
from peer_vllm import verifypd_config  # noqa: E402
from peer_workloads import offline_workload  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402
from torch.profiler import profile as torch_profile  # noqa: E402

BUCKET_S = 0.25
# GPU kernels and copies; on a CPU (the logic check) the host ops stand in for them
ACTIVITY = {True: ProfilerActivity.CUDA, False: ProfilerActivity.CPU}
KINDS = (  # first match wins; lower-case substrings of kernel names
    ("attention", ("attention", "attn", "merge_splits")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas", "matmul", "_mm_")),
    ("norm/rope/act", ("rms", "rope", "silu", "store_kv", "norm")),
    ("sampling", ("argmax", "sample", "softmax", "topk", "sort", "gather", "advance")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def summarize(events: list[tuple[int, int, int, str]], span_ns: int) -> dict[str, Any]:
    """events: (start_ns, end_ns, stream, name) of GPU activity in one window."""
    if not events:
        return {"span_ms": span_ns / 1e6, "busy_frac": 0.0}
    events.sort()
    busy, cur_a, cur_b = 0, events[0][0], events[0][1]
    for a, b, _, _ in events[1:]:
        if a > cur_b:
            busy, cur_a, cur_b = busy + cur_b - cur_a, a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    per_stream: dict[int, int] = defaultdict(int)
    per_kind: dict[str, int] = defaultdict(int)
    per_name: dict[str, list[int]] = defaultdict(list)
    for a, b, stream, name in events:
        per_stream[stream] += b - a
        per_kind[kind_of(name)] += b - a
        per_name[name[:70]].append(b - a)
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "span_ms": span_ns / 1e6,
        "busy_ms": busy / 1e6,
        "busy_frac": busy / span_ns,
        "stream_busy_ms": {str(s): v / 1e6 for s, v in sorted(per_stream.items())},
        "kind_ms": {k: v / 1e6 for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "count": len(v), "total_ms": sum(v) / 1e6,
                         "mean_us": sum(v) / len(v) / 1e3} for n, v in top],
    }  # fmt: skip


async def run_once(engine, prompts, out_lens, windows, tag: str, detok: bool) -> dict[str, Any]:
    n = len(prompts)
    first: list[float | None] = [None] * n
    done: list[float | None] = [None] * n
    tokens_at: list[tuple[float, int]] = []
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        params = greedy(out_lens[i], detokenize=detok)
        async for out in engine.generate(f"{tag}-{i}", prompts[i], params):
            now = time.perf_counter() - t0
            if first[i] is None:
                first[i] = now
            tokens_at.append((now, len(out.new_token_ids)))
        done[i] = time.perf_counter() - t0

    traces: list[dict[str, Any]] = []
    gpu = torch.cuda.is_available()

    async def profiler() -> None:
        for start, end in windows:
            await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
            if all(d is not None for d in done):
                return
            prof = torch_profile(activities=[ACTIVITY[gpu]])
            prof.__enter__()
            a = time.perf_counter_ns()
            at = (
                time.perf_counter() - t0
            )  # later than asked when the last window's parsing ran late
            await asyncio.sleep(end - start)
            if gpu:
                torch.cuda.synchronize()
            b = time.perf_counter_ns()
            parse = time.perf_counter()
            prof.__exit__(None, None, None)  # parses the trace: the event loop stalls meanwhile
            traces.append({"window_s": [start, end], "started_s": at, "prof": prof,
                           "span_ns": b - a, "parse_s": time.perf_counter() - parse})  # fmt: skip

    jobs = [one(i) for i in range(n)]
    if windows:
        jobs.append(profiler())
    pauses: list[tuple[int, float]] = []  # (generation, seconds) of each garbage collection
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    try:
        await asyncio.gather(*jobs)
    finally:
        gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - t0
    buckets = int(wall / BUCKET_S) + 1
    toks = [0] * buckets
    for t, k in tokens_at:
        toks[int(t / BUCKET_S)] += k
    course = [{"t_s": i * BUCKET_S, "out_tok_s": toks[i] / BUCKET_S,
               "started": sum(f is not None and f <= (i + 1) * BUCKET_S for f in first),
               "running": sum(f is not None and f <= (i + 1) * BUCKET_S
                              and (d is None or d > (i + 1) * BUCKET_S)
                              for f, d in zip(first, done, strict=True))}
              for i in range(buckets)]  # fmt: skip
    result = {"wall_s": wall, "output_tokens": sum(k for _, k in tokens_at),
              "last_first_token_s": max(f for f in first if f is not None),
              "course": course, "gc_frozen_objects": gc.get_freeze_count(),
              "gc_pauses": {f"gen{g}": {"count": len(ps), "total_ms": sum(ps) * 1e3,
                                        "max_ms": max(ps, default=0.0) * 1e3}
                            for g in range(3)
                            for ps in [[d for k, d in pauses if k == g]]}}  # fmt: skip
    result["windows"] = []
    for tr in traces:
        kind = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
        evs = [
            (e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id(), e.name())
            for e in tr["prof"].profiler.kineto_results.events()
            if e.device_type() == kind
        ]
        lo = min((a for a, *_ in evs), default=0)
        hi = max((b for _, b, *_ in evs), default=0)
        result["windows"].append({"window_s": tr["window_s"], "started_s": tr["started_s"],
                                  "parse_s": tr["parse_s"],
                                  **summarize(evs, max(hi - lo, tr["span_ns"]))})  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--windows", nargs="*", default=["0.5:1.5", "5:6", "11:11.5"],
                   help="START:END seconds into the traced run")  # fmt: skip
    p.add_argument("--offline-requests", type=int, default=256)
    p.add_argument("--offline-lens", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--lane-mode", default="three", choices=["three", "single"])
    p.add_argument("--detokenize", action="store_true", help="make text (peer_vllm: ids only)")
    p.add_argument("--no-trace", action="store_true", help="the untraced run only")
    p.add_argument("--out", default=None, help="default: bench/results/profile/")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    windows = [tuple(float(x) for x in w.split(":")) for w in args.windows]
    peer = peer_args(["run", "--model", args.model, "--offline-requests",
                      str(args.offline_requests), "--offline-lens",
                      *map(str, args.offline_lens)])  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        peer.max_num_batched_tokens, peer.num_kv_blocks = 512, 256
    cfg = replace(verifypd_config(peer, device, "offline", peer.max_num_seqs),
                  lane_mode=args.lane_mode)  # fmt: skip
    prompts, out_lens = offline_workload(peer)
    llm = AsyncLLM(cfg)
    try:
        warm = [p[:16] for p in prompts[:8]]
        run = llm.loop.run_until_complete
        kv = llm.engine.core.kv  # each run starts with no cached prefix (the same prompts)
        run(run_once(llm.engine, warm, [16] * len(warm), [], "w", args.detokenize))
        kv.reset_prefix_cache()
        plain = run(run_once(llm.engine, prompts, out_lens, [], "a", args.detokenize))
        traced = {"wall_s": None, "windows": []}
        if not args.no_trace:
            kv.reset_prefix_cache()
            traced = run(run_once(llm.engine, prompts, out_lens, windows, "b", args.detokenize))
    finally:
        llm.close()
    rows = []
    for w in traced["windows"]:
        w["window_s"] = [round(w["started_s"], 2), round(w["started_s"] + w["span_ms"] / 1e3, 2)]
        kinds = " ".join(f"{k}={v:.0f}" for k, v in w.get("kind_ms", {}).items())
        streams = " ".join(f"{v:.0f}" for v in w.get("stream_busy_ms", {}).values())
        rows.append([f"{w['window_s'][0]}-{w['window_s'][1]}", f"{w['span_ms']:.0f}",
                     f"{w['busy_frac']:.2f}", streams, kinds])  # fmt: skip
    print(
        f"untraced wall {plain['wall_s']:.2f} s ({plain['output_tokens'] / plain['wall_s']:.0f}"
        f" out tok/s), last first token at {plain['last_first_token_s']:.2f} s; traced wall "
        f"{traced['wall_s']} s; gc pauses (count, ms): "
        + " ".join(f"{g} {v['count']}/{v['total_ms']:.0f}" for g, v in plain["gc_pauses"].items())
    )
    if rows:
        print(format_table(["window s", "span ms", "busy", "stream busy ms",
                            "kernel ms by kind"], rows))  # fmt: skip
    course = plain["course"]
    step = max(1, len(course) // 12)
    print(format_table(["t s", "out tok/s", "started", "running"],
                       [[f"{c['t_s']:.2f}", f"{c['out_tok_s']:.0f}", c["started"], c["running"]]
                        for c in course[::step]]))  # fmt: skip
    meta = metadata("profile_offline", sys.argv[1:] if argv is None else argv, vars(args), device)
    report = {**meta, "engine_config": cfg, "untraced": plain, "traced": traced}
    path = result_path(args.out, "profile_offline", device, "json", args.tag)
    print("wrote", write_json(path, report))
    return report


if __name__ == "__main__":
    main()
