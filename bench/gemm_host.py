"""Host time of one eager cuBLAS GEMM (``F.linear``) on a prompt step's projection shapes: a row
count cuBLAS has seen before against one it has not, and inside a simulated 28-layer prompt step
of a new row count (its first layer against the rest). Why an eager prompt step's launch is
host-bound, and what ``EngineConfig.prompt_token_bucket`` (row counts padded to a bucket) saves.

Host time only: each call is timed on the host, the GPU is synchronized between groups of calls
so that the launch queue never fills.

    python bench/gemm_host.py
    python bench/gemm_host.py --device cpu --model tiny   # logic check only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import add_common_args, format_table, start_run  # noqa: E402

SCRIPT = "gemm_host"
SHAPES = {  # model: projection -> (N, K, bias)
    "qwen2.5-7b": {"qkv": (4608, 3584, True), "o": (3584, 3584, False),
                   "gate_up": (37888, 3584, False), "down": (3584, 18944, False)},
    "tiny": {"qkv": (256, 64, True), "o": (64, 64, False), "gate_up": (256, 64, False),
             "down": (64, 128, False)},
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-7b")
    p.add_argument("--calls", type=int, default=200, help="timed calls per case")
    p.add_argument("--layers", type=int, default=28, help="layers of the simulated prompt step")
    p.add_argument("--steps", type=int, default=20, help="simulated prompt steps")
    add_common_args(p)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _p50_us(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e6


def one_call(weights, device, dtype, calls: int) -> dict[str, dict[str, float]]:
    """Per projection: p50 host µs of a call at a row count seen before, at one never seen, and
    at those again."""
    out = {}
    for name, (w, b) in weights.items():
        k = w.shape[1]
        cases = {"seen": [98] * calls, "new": list(range(300, 300 + calls))}
        cases["new_again"] = cases["new"]
        xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in (97, 98, *cases["new"])}
        F.linear(xs[97], w, b)
        F.linear(xs[98], w, b)  # "seen" from here on
        _sync(device)
        res = {}
        for case, rows in cases.items():
            times = []
            for i, m in enumerate(rows):
                t = time.perf_counter()
                F.linear(xs[m], w, b)
                times.append(time.perf_counter() - t)
                if i % 20 == 19:
                    _sync(device)
            _sync(device)
            res[f"{case}_p50_us"] = _p50_us(times)
        out[name] = res
    return out


def prompt_steps(weights, device, dtype, layers: int, steps: int) -> dict[str, float]:
    """Simulated prompt steps, each of a new row count: every projection once per layer."""
    first, rest, totals = [], [], []
    for step in range(steps):
        m = 150 + 7 * step
        x = {
            n: torch.randn(m, w.shape[1], device=device, dtype=dtype)
            for n, (w, _) in weights.items()
        }
        _sync(device)
        total = 0.0
        for layer in range(layers):
            for name, (w, b) in weights.items():
                t = time.perf_counter()
                F.linear(x[name], w, b)
                dt = time.perf_counter() - t
                total += dt
                (first if layer == 0 else rest).append(dt)
        _sync(device)
        totals.append(total)
    return {"first_layer_p50_us": _p50_us(first), "other_layers_p50_us": _p50_us(rest),
            "gemm_host_ms_per_step": sum(totals) / len(totals) * 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args)
    args, device = run.args, run.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    weights = {
        name: (torch.randn(n, k, device=device, dtype=dtype) * 0.01,
               torch.randn(n, device=device, dtype=dtype) if bias else None)
        for name, (n, k, bias) in SHAPES[args.model].items()
    }  # fmt: skip
    calls = one_call(weights, device, dtype, args.calls)
    steps = prompt_steps(weights, device, dtype, args.layers, args.steps)
    run.report["results"] = {"one_call": calls, "prompt_steps": steps}
    rows = [[n, f"{r['seen_p50_us']:.1f}", f"{r['new_p50_us']:.1f}", f"{r['new_again_p50_us']:.1f}"]
            for n, r in calls.items()]  # fmt: skip
    text = format_table(["projection", "seen µs", "new µs", "new again µs"], rows)
    text += (f"\nprompt step of a new row count: first layer {steps['first_layer_p50_us']:.1f} µs "
             f"a GEMM, others {steps['other_layers_p50_us']:.1f} µs; "
             f"{steps['gemm_host_ms_per_step']:.2f} ms of GEMM host time a step")  # fmt: skip
    run.finish(text)
    return run.report


if __name__ == "__main__":
    main()
