"""Where a batch-1 speculative step spends its time: draft proposal vs target verify vs the
engine's own host work, each as host time and as GPU time (CUDA events), against plain decode.

The drafts stay on the device, so a proposal returns once its steps are enqueued, and the
verify (or plain step) is launched behind it; the step's one host sync comes at its result.
Per phase: "host ms" is the time the call took on the host (enqueueing), "gpu ms" the span
between CUDA events recorded around it, read after the step's sync (for the launch: from when
the GPU reached it, after the drafting, to the end of the step's kernels).

    python bench/profile_spec.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import add_spec_args, format_table, metadata, result_path, write_json  # noqa: E402
from harness import synthetic_spec  # noqa: E402
from torch.profiler import ProfilerActivity, record_function  # noqa: E402
from torch.profiler import profile as torch_profile  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.lanes.sync_driver import SyncDriver  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402


class PhaseTimer:
    """Wraps a bound method: host seconds of every call and a pair of CUDA events around it
    (no sync: ``resolve`` reads them after the step's own sync), inside a profiler range named
    after it (``--trace`` files each kernel under its phase)."""

    def __init__(self, obj, name: str, log: dict[str, list[tuple[float, float]]]) -> None:
        self.inner, self.name, self.log = getattr(obj, name), name, log
        self.pending: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        self.sync_each = False
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        with record_function(f"phase:{self.name}"):
            out = self.inner(*args, **kwargs)
        end.record()
        if self.sync_each:  # --trace: each phase's kernels finish inside its host range
            end.synchronize()
        self.pending.append((time.perf_counter() - t0, start, end))
        return out

    def resolve(self) -> None:
        for host, start, end in self.pending:
            end.synchronize()
            self.log[self.name].append((host, start.elapsed_time(end)))
        self.pending.clear()


def profile(args, spec_on: bool) -> dict:
    spec = synthetic_spec(args)
    cfg = EngineConfig(model=args.model, spec=spec if spec_on else SpecConfig(),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=4096),
                       cache=CacheConfig(num_blocks=512, enable_prefix_caching=False))  # fmt: skip
    core = EngineCore(cfg)
    driver = SyncDriver(core)
    ids = np.random.default_rng(0).integers(0, 150000, args.prompt_len).tolist()
    core.add_request("r", ids, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    for _ in range(10):
        driver.step()
    log: dict[str, list[tuple[float, float]]] = defaultdict(list)
    timers = [PhaseTimer(core.runner, "launch", log)]
    if spec_on:
        timers.append(PhaseTimer(driver.policy, "propose", log))
    steps, tokens, t0 = 0, 0, time.perf_counter()
    step_times = []
    for _ in range(args.steps):
        s0 = time.perf_counter()
        outs = driver.step()
        step_times.append(time.perf_counter() - s0)
        for timer in timers:
            timer.resolve()
        tokens += sum(len(o.new_token_ids) for o in outs)
        steps += 1
    wall = time.perf_counter() - t0
    for timer in timers:
        timer.sync_each = True
    trace = kernel_trace(driver, args.trace) if args.trace else None
    phases = {
        name: {"host_ms": 1e3 * float(np.median([w for w, _ in v])),
               "gpu_ms": float(np.median([g for _, g in v]))}
        for name, v in log.items()
    }  # fmt: skip
    return {"spec": spec_on, "config": cfg, "steps": steps, "tokens": tokens,
            "tok_s": tokens / wall, "tokens_per_step": tokens / steps,
            "step_ms": 1e3 * float(np.median(step_times)), "phases": phases,
            "trace": trace}  # fmt: skip


def kernel_trace(driver: SyncDriver, steps: int) -> dict:
    """Profiles ``steps`` more engine steps and files every GPU kernel under the phase whose
    host range holds its start (the timers sync at the end of each phase here, so its kernels
    finish inside it); kernels outside every phase are the step's own bookkeeping ("step")."""
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            driver.step()
        torch.cuda.synchronize()
    events = prof.events()
    ranges = [(e.name.removeprefix("phase:"), e.time_range.start, e.time_range.end)
              for e in events if e.name.startswith("phase:")]  # fmt: skip
    kernels: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith("phase:"):
            continue  # host ops, and the phase ranges' own annotations on the GPU timeline
        t = e.time_range.start
        phase = next((n for n, a, b in ranges if a <= t <= b), "step")
        kernels[phase].append((t, e.time_range.end, e.name[:80]))
    out = {}
    for phase, ks in kernels.items():
        ks.sort()
        busy = sum(b - a for a, b, _ in ks)
        by_name: dict[str, list[float]] = defaultdict(list)
        for a, b, name in ks:
            by_name[name].append(b - a)
        out[phase] = {
            "kernels_per_step": len(ks) / steps,
            "kernel_ms_per_step": busy / steps / 1e3,
            "by_name": sorted(
                ({"name": n, "per_step": len(v) / steps, "ms_per_step": sum(v) / steps / 1e3,
                  "mean_us": sum(v) / len(v)} for n, v in by_name.items()),
                key=lambda r: -r["ms_per_step"],
            ),
        }  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    add_spec_args(p)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--trace", type=int, default=0, help="profile this many more steps per kernel")
    p.add_argument("--out", default=None, help="default: bench/results/profile/")
    args = p.parse_args()
    rows, table = [], []
    for spec_on in (False, True):
        r = profile(args, spec_on)
        rows.append(r)
        for name, ph in r["phases"].items():
            table.append(["spec" if spec_on else "plain", name, f"{ph['host_ms']:.2f}",
                          f"{ph['gpu_ms']:.2f}", f"{r['step_ms']:.2f}",
                          f"{r['tokens_per_step']:.2f}", f"{r['tok_s']:.1f}"])  # fmt: skip
    print(format_table(["mode", "phase", "host ms", "gpu ms", "step ms", "tok/step", "tok/s"],
                       table))  # fmt: skip
    for r in rows:
        for phase, t in (r["trace"] or {}).items():
            print(
                f"\n{'spec' if r['spec'] else 'plain'} {phase}: {t['kernels_per_step']:.0f} "
                f"kernels, {t['kernel_ms_per_step']:.3f} ms of kernels per step"
            )
            for k in t["by_name"][:14]:
                print(f"  {k['per_step']:6.1f} x {k['mean_us']:7.2f} us  {k['name']}")
    device = torch.device("cuda")
    report = {**metadata("profile_spec", sys.argv[1:], vars(args), device), "results": rows}
    print("wrote", write_json(result_path(args.out, "profile_spec", device, "json"), report))


if __name__ == "__main__":
    main()
