"""Kernel-level profile of one decode forward at --batch (eager, same kernels the graph replays):
how many kernels, how much GPU time in GEMMs vs everything else, against the bytes floor.

    python bench/profile_decode.py --models dummy:qwen2.5-1.5b dummy:qwen2.5-7b
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from common import kernel_kind, metadata, result_path, write_json  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig  # noqa: E402
from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.lanes.sync_driver import SyncDriver  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402


def profile_model(spec: str, copy_gbps: float | None, batch: int = 1, pdl: bool = True) -> dict:
    cache = CacheConfig(num_blocks=40 * batch + 256)
    sched = SchedulerConfig(max_num_seqs=max(8, batch), max_model_len=4096)
    cfg = EngineConfig(model=spec, cuda_graphs=True, cache=cache, scheduler=sched,
                       kernels=KernelConfig(pdl=pdl))  # fmt: skip
    core = EngineCore(cfg)
    for i in range(batch):
        prompt = [100 + (i * 7 + j) % 30000 for j in range(512)]
        core.add_request(f"p{i}", prompt, SamplingParams(max_tokens=64, temperature=0))
    driver = SyncDriver(core)
    for _ in range(8 + batch // 4):
        driver.step()  # prefill + decodes: kernels compiled, graphs warm
    plan = core.scheduler.schedule_mixed()
    core.scheduler.begin_step(plan)
    inputs = core.runner.prepare(plan)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        core.runner.forward(inputs, inputs.sample_rows)  # eager: the kernels the graph holds
        torch.cuda.synchronize()
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kernel_kind(evt.name)].append(evt.device_time_total / 1e3)  # ms
            by_name[evt.name[:90]].append(evt.device_time_total / 1e3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        core.runner.graphs[1].run(inputs.input_ids, inputs.positions, inputs.meta)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    weight_bytes = sum(p.numel() * p.element_size() for p in core.loaded.model.parameters())
    floor_ms = weight_bytes / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
    return {
        "model": spec,
        "batch": batch,
        "config": cfg,  # every EngineConfig field, kernels included (common.json_default)
        "num_kernels": sum(len(v) for v in by_kind.values()),
        "kernels_by_kind": {k: len(v) for k, v in by_kind.items()},
        "gpu_ms_by_kind": {k: round(sum(v), 4) for k, v in by_kind.items()},
        "kernels_by_name": sorted(
            ({"name": k, "count": len(v), "ms": round(sum(v), 4)} for k, v in by_name.items()),
            key=lambda r: -r["ms"],
        ),
        "eager_kernel_ms_total": round(sum(sum(v) for v in by_kind.values()), 4),
        "graph_replay_ms_median": round(sorted(times)[len(times) // 2], 4),
        "weight_bytes": weight_bytes,
        "bytes_floor_ms": floor_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen2.5-1.5b", "dummy:qwen2.5-7b"])
    p.add_argument("--copy-gbps", type=float, default=4200.0, help="measured copy bandwidth")
    p.add_argument("--out", default=None, help="default: bench/results/profile/")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--no-pdl", action="store_true", help="launch without programmatic deps")
    args = p.parse_args()
    rows = [profile_model(m, args.copy_gbps, args.batch, not args.no_pdl) for m in args.models]
    print("model                kernels  matmul ms  attn ms  other ms  graph ms  floor ms")
    for r in rows:
        g = r["gpu_ms_by_kind"]
        print(f"{r['model']:<20} {r['num_kernels']:>7} {g.get('matmul', 0):>10.3f} "
              f"{g.get('attention', 0):>8.3f} {g.get('other', 0):>9.3f} "
              f"{r['graph_replay_ms_median']:>9.3f} {r['bytes_floor_ms']:>9.3f}")  # fmt: skip
    for r in rows:
        print(f"\n{r['model']}: kernels by name (count, ms per forward)")
        for k in r["kernels_by_name"][:20]:
            print(f"  {k['count']:>4} {k['ms']:>8.4f}  {k['name']}")
    device = torch.device("cuda")
    report = {**metadata("profile_decode", sys.argv[1:], vars(args), device), "results": rows}
    tag = "-".join(
        filter(None, [f"b{args.batch}" if args.batch > 1 else "", "no-pdl" * args.no_pdl])
    )
    path = result_path(args.out, "profile_decode", device, "json", tag)
    print("wrote", write_json(path, report))


if __name__ == "__main__":
    main()
