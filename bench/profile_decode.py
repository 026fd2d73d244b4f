"""Kernel-level profile of one decode forward at --batch (eager, same kernels the graph replays):
how many kernels, how much GPU time in GEMMs vs everything else, against the bytes floor.

    python bench/profile_decode.py --models dummy:qwen2.5-1.5b dummy:qwen2.5-7b
    python bench/profile_decode.py --models dummy:qwen2.5-0.5b --weight-prefetch off auto all \\
        --ab-rounds 10   # the interleaved A/B of graph replays (and its .png)
    python bench/profile_decode.py --models dummy:qwen2.5-0.5b --ab-rounds 10 \\
        --kernels default fuse_norm_max_n=16384 weight_prefetch=all,fuse_norm_max_n=16384
    python bench/profile_decode.py --replot RESULT.json   # redraw a saved A/B's .png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from common import bar_panels, kernel_kind, metadata, result_path, write_json  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig  # noqa: E402
from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.lanes.sync_driver import SyncDriver  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402


def profile_model(
    spec: str, copy_gbps: float | None, batch: int = 1, pdl: bool = True, variant: str = "default"
) -> tuple[dict, Callable[[int], float]]:
    """The kernel profile of one decode forward, and a timer of back-to-back graph replays
    (``timer(n)``: ms per replay over n replays) kept for the interleaved A/B."""
    cache = CacheConfig(num_blocks=40 * batch + 256)
    sched = SchedulerConfig(max_num_seqs=max(8, batch), max_model_len=4096)
    cfg = EngineConfig(model=spec, cuda_graphs=True, cache=cache, scheduler=sched,
                       kernels=kernel_config(variant, pdl=pdl))  # fmt: skip
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

    def timer(n: int) -> float:
        start.record()
        for _ in range(n):
            core.runner.graphs[1].run(inputs.input_ids, inputs.positions, inputs.meta)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    return {
        "model": spec,
        "batch": batch,
        "variant": variant,
        "weight_prefetch": cfg.kernels.weight_prefetch,
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
    }, timer


def kernel_config(variant: str, **fixed) -> KernelConfig:
    """The KernelConfig of a variant: "default", or FIELD=VALUE pairs joined by commas (each
    value parsed as its field's default's type)."""
    fields = {} if variant == "default" else dict(kv.split("=", 1) for kv in variant.split(","))
    defaults = KernelConfig()
    parsed = {}
    for name, text in fields.items():
        if not hasattr(defaults, name):
            raise SystemExit(f"--kernels: KernelConfig has no field {name!r}")
        kind = type(getattr(defaults, name))
        parsed[name] = text in ("1", "true", "True") if kind is bool else kind(text)
    return KernelConfig(**{**fixed, **parsed})


def interleaved_ab(
    model: str, timers: list[tuple[str, Callable[[int], float]]], rounds: int, replays: int
) -> dict:
    """Each round times every variant's replays in turn (the order rotating), so a drift of the
    GPU's clocks falls on all of them alike."""
    per: dict[str, list[float]] = {name: [] for name, _ in timers}
    for _, timer in timers:
        timer(replays)  # warm
    for r in range(rounds):
        for name, timer in timers[r % len(timers) :] + timers[: r % len(timers)]:
            per[name].append(timer(replays))
    base = statistics.median(per[timers[0][0]])
    variants = [
        {"variant": name, "median_ms": round(statistics.median(t), 4),
         "min_ms": round(min(t), 4), "max_ms": round(max(t), 4),
         "ratio_median": round(statistics.median(t) / base, 4), "ms_per_round": t}
        for name, t in per.items()
    ]  # fmt: skip
    return {"model": model, "rounds": rounds, "replays": replays, "variants": variants}


def main() -> None:
    if sys.argv[1:2] == ["--replot"]:
        return replot(sys.argv[2])
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen2.5-1.5b", "dummy:qwen2.5-7b"])
    p.add_argument("--copy-gbps", type=float, default=4200.0, help="measured copy bandwidth")
    p.add_argument("--out", default=None, help="default: bench/results/profile/")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--no-pdl", action="store_true", help="launch without programmatic deps")
    p.add_argument(
        "--kernels",
        nargs="+",
        default=[],
        help="KernelConfig variants, each 'default' or FIELD=VALUE[,FIELD=VALUE...]; "
        "each model runs under each in turn (an A/B with --ab-rounds)",
    )
    p.add_argument("--weight-prefetch", nargs="+", default=[],
                   help="KernelConfig.weight_prefetch values, each model run under each in turn "
                        "(an A/B: name the first again last to see the drift)")  # fmt: skip
    p.add_argument(
        "--ab-rounds",
        type=int,
        default=0,
        help="then this many interleaved rounds of back-to-back replays per variant "
        "(the A/B of --weight-prefetch; engines of one model kept side by side)",
    )
    p.add_argument("--ab-replays", type=int, default=100, help="replays per variant per round")
    args = p.parse_args()
    variants = list(
        dict.fromkeys(  # each variant once, in order
            [f"weight_prefetch={v}" for v in args.weight_prefetch] + args.kernels
        )
    ) or ["default"]
    for variant in variants:
        kernel_config(variant)  # a bad variant fails before any model loads
    rows, ab = [], []
    for m in args.models:
        timers = []
        for variant in variants:
            row, timer = profile_model(m, args.copy_gbps, args.batch, not args.no_pdl, variant)
            rows.append(row)
            timers.append((variant, timer))
        if args.ab_rounds:
            ab.append(interleaved_ab(m, timers, args.ab_rounds, args.ab_replays))
        del timers  # the engines go with their timers before the next model loads
        torch.cuda.empty_cache()
    print("model                variant  kernels  matmul ms  attn ms  other ms  graph ms  floor ms")
    for r in rows:
        g = r["gpu_ms_by_kind"]
        print(f"{r['model']:<20} {r['variant']:<8} {r['num_kernels']:>7} "
              f"{g.get('matmul', 0):>10.3f} "
              f"{g.get('attention', 0):>8.3f} {g.get('other', 0):>9.3f} "
              f"{r['graph_replay_ms_median']:>9.3f} {r['bytes_floor_ms']:>9.3f}")  # fmt: skip
    for r in rows:
        print(f"\n{r['model']} ({r['variant']}): kernels by name (count, ms per forward)")
        for k in r["kernels_by_name"][:20]:
            print(f"  {k['count']:>4} {k['ms']:>8.4f}  {k['name']}")
    for a in ab:
        print(
            f"\n{a['model']}: ms per replay over {a['rounds']} interleaved rounds of "
            f"{a['replays']} (median [min, max]; ratio to {a['variants'][0]['variant']})"
        )
        for v in a["variants"]:
            print(f"  {v['variant']:<8} {v['median_ms']:.4f} [{v['min_ms']:.4f}, "
                  f"{v['max_ms']:.4f}]  {v['ratio_median']:.3f}x")  # fmt: skip
    device = torch.device("cuda")
    report = {**metadata("profile_decode", sys.argv[1:], vars(args), device), "results": rows,
              "ab": ab}  # fmt: skip
    tag = "-".join(
        filter(
            None,
            [
                f"b{args.batch}" if args.batch > 1 else "",
                "no-pdl" * args.no_pdl,
                "prefetch" * bool(args.weight_prefetch),
                "kernels" * bool(args.kernels),
            ],
        )
    )
    path = result_path(args.out, "profile_decode", device, "json", tag)
    print("wrote", write_json(path, report))
    if ab:
        print("wrote", plot_ab(report, path.with_suffix(".png")))


def plot_ab(report: dict, path: Path) -> Path | None:
    """One panel per model: ms per replay of each variant (median over the rounds)."""
    panels = []
    for a in report["ab"]:
        names = [v["variant"] for v in a["variants"]]
        series = {"ms per replay (median)": [v["median_ms"] for v in a["variants"]]}
        title = f"{a['model']}, batch {report['results'][0]['batch']}: graph replays"
        panels.append((title, "ms", names, series))
    return bar_panels(path, panels, ncols=len(panels))


def replot(json_path: str) -> None:
    """Draw the A/B plot of a saved result (its .png beside it)."""
    path = Path(json_path)
    print("wrote", plot_ab(json.loads(path.read_text()), path.with_suffix(".png")))


if __name__ == "__main__":
    main()
