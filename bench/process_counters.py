"""Process-wide counters a sweep run may owe part of its latency to, recorded per run
(``mixed.py --sweep``, each row's ``process``): the CUDA caching allocator's calls into the
driver (``cudaMalloc`` / ``cudaFree``, allocations retried after the cache was freed,
synchronizations of every stream) and Python's garbage collections with their pauses.

They exist to test the explanations of the slow first ~45 s of a fresh process's traffic
(docs/performance.md): a run that pays for new device memory or long collections shows it
here, beside its latencies. Beside them, the process's CPU seconds and what the machine did
(``machine_probe``: the host's busy and stolen CPU shares, the GPU's SM clock and throttle
reasons).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from machine_probe import GpuClocks, host_cpu_ticks, host_shares, nvml_reader

# torch.cuda.memory_stats keys (counts since the process started) -> the row's names.
ALLOCATOR_KEYS = {
    "num_device_alloc": "cuda_mallocs",
    "num_device_free": "cuda_frees",
    "num_alloc_retries": "alloc_retries",
    "num_sync_all_streams": "alloc_stream_syncs",
}


class ProcessCounters:
    """Counters since the process started (``snapshot``); a run's share: ``begin`` before it,
    ``since`` after. Installs a garbage-collector callback that times every collection;
    ``close`` removes it."""

    def __init__(
        self, device: torch.device, clock=time.perf_counter, stat_path: str = "/proc/stat",
        gpu_clocks: GpuClocks | None = None,
    ) -> None:  # fmt: skip
        self.device, self.clock, self.stat_path = device, clock, stat_path
        if gpu_clocks is None and device.type == "cuda":
            read = nvml_reader(device.index or 0)
            gpu_clocks = GpuClocks(read) if read is not None else None
        self.gpu_clocks = gpu_clocks
        self.num_collections = [0, 0, 0]  # per generation
        self.pause_s = 0.0
        self.max_pause_s = 0.0
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            pause = self.clock() - self._started
            self.num_collections[info["generation"]] += 1
            self.pause_s += pause
            self.max_pause_s = max(self.max_pause_s, pause)
            self._started = None

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f"gc_collections_gen{g}": n for g, n in enumerate(self.num_collections)
        }
        out["gc_pause_ms"] = self.pause_s * 1e3
        out["cpu_s"] = time.process_time()
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            for key, name in ALLOCATOR_KEYS.items():
                if key in stats:
                    out[name] = stats[key]
            out["reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
        return out

    def begin(self) -> dict[str, Any]:
        """A snapshot to pass to ``since``; the longest pause counts from here, and the GPU's
        clocks are sampled from here."""
        self.max_pause_s = 0.0
        if self.gpu_clocks is not None:
            self.gpu_clocks.start()
        return {**self.snapshot(), "_host_ticks": host_cpu_ticks(self.stat_path)}

    def since(self, base: dict[str, Any]) -> dict[str, Any]:
        """The counters' growth since ``base`` (``begin``'s); ``reserved_gib`` as it is now,
        ``gc_max_pause_ms`` the longest pause since ``begin``; the machine's shares and the
        GPU's clocks over the same span."""
        now = self.snapshot()
        out = {k: v - base[k] for k, v in now.items() if k in base and k != "reserved_gib"}
        if "reserved_gib" in now:
            out["reserved_gib"] = now["reserved_gib"]
        out["gc_max_pause_ms"] = self.max_pause_s * 1e3
        before, after = base.get("_host_ticks"), host_cpu_ticks(self.stat_path)
        if before is not None and after is not None:
            out |= host_shares(before, after)
        if self.gpu_clocks is not None:
            out |= self.gpu_clocks.stop()
        return out

    def close(self) -> None:
        if self.gpu_clocks is not None:
            self.gpu_clocks.stop()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
