"""Diagnostic: the GPU timeline of batch-1 decoding through the lane dispatcher, and where the
GPU sits idle waiting for the host.

Profiles a window of one request (torch profiler, CUDA activity), merges every kernel and copy
interval over all streams, and reports the GPU-busy time, the idle gaps (with the kernels on
either side, summed per pair) and, for reference, the pure replay time of each captured graph
(back-to-back replays timed with CUDA events: the GPU cost of a step with no host in between).

    python bench/timeline.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import add_spec_args, format_table, metadata, result_path, write_json  # noqa: E402
from harness import synthetic_spec  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402
from torch.profiler import profile as torch_profile  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from verifypd.lanes.async_engine import AsyncEngine  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402


def gaps_of(intervals: list[tuple[float, float, str]], min_gap_us: float) -> dict:
    """Union of [start, end) intervals (us) and the idle gaps between them."""
    intervals.sort()
    busy, gaps = 0.0, []
    cur_a, cur_b, cur_name = intervals[0]
    for a, b, name in intervals[1:]:
        if a > cur_b:
            busy += cur_b - cur_a
            gaps.append((a - cur_b, cur_name, name))
            cur_a, cur_b = a, b
        elif b > cur_b:
            cur_b = b
        if b >= cur_b:
            cur_name = name
    busy += cur_b - cur_a
    span = intervals[-1][1] - intervals[0][0]
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for g, before, after in gaps:
        if g >= min_gap_us:
            pairs[(before[:60], after[:60])].append(g)
    top = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:12]
    by_name: dict[str, list[float]] = defaultdict(list)
    for a, b, name in intervals:
        by_name[name[:60]].append(b - a)
    kernels = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:20]
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "num_gaps_over_min": sum(len(v) for v in pairs.values()),
        "top_gap_pairs": [
            {"before": a, "after": b, "count": len(v), "total_ms": sum(v) / 1e3,
             "mean_us": sum(v) / len(v)}
            for (a, b), v in top
        ],
        "kernels": [{"name": n, "count": len(v), "total_ms": sum(v) / 1e3} for n, v in kernels],
    }  # fmt: skip


async def window(engine: AsyncEngine, ids: list[int], tokens: int, profiled: bool) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prof = torch_profile(activities=[ProfilerActivity.CUDA]) if profiled else None
    if prof is not None:
        prof.__enter__()
    torch.cuda.synchronize()
    verifies = engine.core.spec.num_verifies
    runners = {"target": engine.core.runner}
    if engine.core.spec.drafter is not None:
        runners["draft"] = engine.core.spec.drafter.runner
    before = {k: (r.num_graph_steps, r.num_eager_steps) for k, r in runners.items()}
    t0 = time.perf_counter()
    n = 0
    async for out in engine.generate(f"w{time.time()}", ids, params):
        n += len(out.new_token_ids)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rounds = engine.core.spec.num_verifies - verifies or n  # plain: one token per step
    result = {"tokens": n, "wall_ms": wall * 1e3, "tok_s": n / wall, "rounds": rounds,
              "ms_per_round": wall * 1e3 / rounds,
              "graph_eager_steps": {k: (r.num_graph_steps - before[k][0],
                                        r.num_eager_steps - before[k][1])
                                    for k, r in runners.items()}}  # fmt: skip
    if prof is not None:
        prof.__exit__(None, None, None)
        cuda = torch.autograd.DeviceType.CUDA
        ivs = [(e.time_range.start, e.time_range.end, e.name)
               for e in prof.events() if e.device_type == cuda]  # fmt: skip
        result["timeline"] = gaps_of(ivs, 10.0)
    return result


def replay_ms(graphs, batch: int = 1, reps: int = 50) -> dict[str, float]:
    """Back-to-back replays (GPU time per step), and the median replay launched onto an idle
    GPU, event to event (so the launch latency the GPU waits for is included)."""
    g = graphs.graphs[batch]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        g.replay()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    warm = start.elapsed_time(end) / reps
    cold = []
    for _ in range(20):
        torch.cuda.synchronize()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        cold.append(start.elapsed_time(end))
    return {"back_to_back": warm, "from_idle": float(np.median(cold))}


async def run_mode(args, spec_on: bool, lane_mode: str) -> dict:
    spec = synthetic_spec(args)
    cfg = EngineConfig(model=args.model, lane_mode=lane_mode,
                       spec=spec if spec_on else SpecConfig(),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=4096),
                       cache=CacheConfig(num_blocks=512, enable_prefix_caching=False))  # fmt: skip
    engine = AsyncEngine(cfg)
    ids = np.random.default_rng(0).integers(0, 150000, args.prompt_len).tolist()
    await window(engine, ids, 32, profiled=False)  # warm
    plain = await window(engine, ids, args.tokens, profiled=False)
    traced = await window(engine, ids, args.tokens, profiled=True)
    core = engine.core
    replays = {f"target_q{q}": replay_ms(g) for q, g in core.runner.graphs.items()}
    if core.spec.drafter is not None:
        for q, g in core.spec.drafter.runner.graphs.items():
            replays[f"draft_q{q}"] = replay_ms(g)
    await engine.stop()
    del engine, core
    torch.cuda.empty_cache()
    return {"spec": spec_on, "lane_mode": lane_mode, "config": cfg, "untraced": plain,
            "traced": traced, "replay_ms": replays}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    add_spec_args(p)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--modes", nargs="+", default=["plain:three", "spec:three", "spec:single"])
    p.add_argument("--out", default=None, help="default: bench/results/profile/")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    rows, table = [], []
    for mode in args.modes:
        kind, lane_mode = mode.split(":")
        r = asyncio.run(run_mode(args, kind == "spec", lane_mode))
        rows.append(r)
        t = r["traced"]["timeline"]
        table.append([mode, f"{r['untraced']['tok_s']:.1f}",
                      f"{r['untraced']['ms_per_round']:.2f}", f"{r['traced']['tok_s']:.1f}",
                      f"{t['busy_ms'] / r['traced']['tokens']:.3f}",
                      f"{t['idle_ms'] / r['traced']['tokens']:.3f}",
                      " ".join(f"{k}={v['back_to_back']:.3f}/{v['from_idle']:.3f}"
                               for k, v in r["replay_ms"].items())])  # fmt: skip
    print(format_table(["mode", "tok/s", "ms/round", "tok/s traced", "busy ms/tok",
                        "idle ms/tok", "replay ms (warm/idle)"], table))  # fmt: skip
    for r in rows:
        print(f"\n{'spec' if r['spec'] else 'plain'}:{r['lane_mode']} top idle gaps")
        for g in r["traced"]["timeline"]["top_gap_pairs"][:8]:
            print(f"  {g['count']:4d} x {g['mean_us']:7.1f} us = {g['total_ms']:6.2f} ms  "
                  f"{g['before'][:40]} -> {g['after'][:40]}")  # fmt: skip
        print("  busiest kernels; graph/eager steps", r["untraced"]["graph_eager_steps"])
        for k in r["traced"]["timeline"]["kernels"][:12]:
            print(f"  {k['count']:6d} {k['total_ms']:8.2f} ms  {k['name']}")
    device = torch.device("cuda")
    report = {**metadata("timeline", sys.argv[1:], vars(args), device), "results": rows}
    print("wrote", write_json(result_path(args.out, "timeline", device, "json", args.tag), report))


if __name__ == "__main__":
    main()
