"""What a sampled token costs outside the forward: the host time of launching the sampling ops
and their GPU time, for the torch int64 noise (``uniform_noise_torch`` + ``exponential_race``)
against the Triton kernels (``kernels.triton_noise_race``, ``KernelConfig.fused_sampling_noise``,
the default on a GPU since 2026-11-28), and the whole of a sampled drafter step's sampling
(``sample_with_probs``) with each. Rows 1 / 4 / 16 over a vocabulary of 151,936 (Qwen2.5), the
same run, the same inputs.

Host time: the wall time of the calls with the GPU idle beforehand. GPU time: CUDA events
around the same calls enqueued behind a sleep kernel (the GPU never waits for the host)::

    python bench/sample_cost.py --out DIR
    python bench/sample_cost.py --replot RESULT.json   # redraw a saved run's .png

Each variant's draws are checked against the torch path's first (they must be equal), and the
aten ops each call dispatches are counted (``torch_ops``; a Triton launch is not one of them).
On CPU the "kernel" variants run the torch ops too: a smoke test, and the op counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    bar_panels,
    format_table,
    metadata,
    resolve_device,
    result_path,
    write_json,
)
from verifypd.engine import sampler  # noqa: E402
from verifypd.engine.sampler import SamplingTensors, processed_probs  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16", help="comma-separated row counts")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=50, help="calls per timing")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


def _torch_race(probs, t):
    u = sampler.uniform_noise_torch(t.seeds, t.positions, probs.shape[-1], 0)
    return sampler.exponential_race(probs, u)


def _kernel_race(probs, t):
    return sampler.noise_race(probs, t.seeds, t.positions, 0)


def _torch_step(logits, t):
    """The drafter's sampling until 2026-11-28: the distribution computed twice, greedy rows
    mixed in whether or not there are any (``any_greedy`` True)."""
    t = replace(t, any_greedy=True)
    probs = processed_probs(logits, t)
    tokens = _torch_race(probs, t)
    greedy = logits.argmax(dim=-1)
    return torch.where(t.temperature == 0, greedy, tokens), processed_probs(logits, t)


class _OpCount(TorchDispatchMode):
    """Counts the aten ops a call dispatches: on a GPU each is (at least) one kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(fn) -> int:
    with _OpCount() as counter:
        fn()
    return counter.count


def _timed(fn, repeats: int, cuda: bool) -> tuple[float, float | None]:
    """(host ms a call, GPU ms a call or None)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    host = (time.perf_counter() - t0) / repeats
    if not cuda:
        return host * 1e3, None
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e6 * max(host * repeats * 1e3, 1.0)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return host * 1e3, start.elapsed_time(end) / repeats


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Host and GPU milliseconds of each variant, one bar a row count."""
    res = report["results"]
    names = list(dict.fromkeys(r["variant"] for r in res))
    panels = []
    for key, what in (("host_ms", "host time of the calls"), ("gpu_ms", "GPU time")):
        series = {f"{n} rows": [next(r[key] or 0.0 for r in res
                                     if r["rows"] == n and r["variant"] == v) for v in names]
                  for n in dict.fromkeys(r["rows"] for r in res)}  # fmt: skip
        panels.append((f"{report['device']}: {what}", "ms", names, series))
    return bar_panels(path, panels, ncols=2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--replot"]:
        path = Path(argv[1])
        print("wrote", plot(json.loads(path.read_text()), path.with_suffix(".png")))
        return {}
    args = parse_args(argv)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    sampler.use_fused_noise(cuda)  # the "kernel" variants (KernelConfig.fused_sampling_noise)
    gen = torch.Generator().manual_seed(0)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, args.vocab, generator=gen) * 3).to(device, torch.bfloat16)
        seeds, positions = list(range(rows)), [100 + r for r in range(rows)]
        t = SamplingTensors.build([0.7] * rows, [0] * rows, [1.0] * rows, seeds, positions, device)
        probs = processed_probs(logits, t)
        variants = {
            "race, torch ops": lambda p=probs, t=t: _torch_race(p, t),
            "race, kernel": lambda p=probs, t=t: _kernel_race(p, t),
            "draft sampling, torch ops": lambda x=logits, t=t: _torch_step(x, t),
            "draft sampling, kernel": lambda x=logits, t=t: sampler.sample_with_probs(x, t),
        }
        same = bool(torch.equal(_torch_race(probs, t), _kernel_race(probs, t)))
        step_tokens = sampler.sample_with_probs(logits, t)[0]
        same_step = bool(torch.equal(_torch_step(logits, t)[0], step_tokens))
        for name, fn in variants.items():
            fn()  # compile / warm
            host, gpu = _timed(fn, args.repeats, cuda)
            results.append({"rows": rows, "variant": name, "host_ms": host, "gpu_ms": gpu,
                            "torch_ops": _ops(fn),
                            "draws_equal": same if "race" in name else same_step})  # fmt: skip
    print(format_table(["rows", "variant", "torch ops", "host ms", "GPU ms", "draws equal"],
                       [[r["rows"], r["variant"], r["torch_ops"], round(r["host_ms"], 4),
                         None if r["gpu_ms"] is None else round(r["gpu_ms"], 4), r["draws_equal"]]
                        for r in results]))  # fmt: skip
    report = {**metadata("sample_cost", argv, vars(args), device), "results": results}
    path = write_json(result_path(args.out, "sample_cost", device, "json", args.tag), report)
    print(f"wrote {path} and {plot(report, path.with_suffix('.png'))}")
    return report


if __name__ == "__main__":
    main()
