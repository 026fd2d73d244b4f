"""The hardware ceilings a benchmark's numbers are read against: device-to-device copy GB/s and
bf16 matmul TFLOP/s, measured with CUDA events in the same script (``hardware_ceilings``, in
every report through ``common.start_run``). None on CPU."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch


def copy_bandwidth_gbps(
    device: torch.device, nbytes: int = 1 << 30, repeats: int = 10
) -> float | None:
    """Device-to-device copy GB/s counting read + write bytes; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _cuda_event_times(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / statistics.median(seconds) / 1e9


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """bf16 [n, n] @ [n, n] TFLOP/s; None on CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    seconds = _cuda_event_times(lambda: torch.matmul(a, b, out=c), repeats)
    return 2 * n**3 / statistics.median(seconds) / 1e12


def _cuda_event_times(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def hardware_ceilings(device: torch.device, skip: bool = False) -> dict[str, Any]:
    if skip or device.type != "cuda":
        return {"copy_gbps": None, "bf16_matmul_tflops": None, "skipped": skip}
    out = {
        "copy_gbps": copy_bandwidth_gbps(device),
        "copy_note": "1 GiB device-to-device copy, read+write bytes, CUDA events, median of 10",
        "bf16_matmul_tflops": matmul_tflops(device),
        "matmul_note": "bf16 8192^3 matmul, CUDA events, median of 10",
    }
    gc.collect()  # the probes' buffers
    torch.cuda.empty_cache()
    return out
