"""Process-wide counters a sweep run may owe part of its latency to, recorded per run
(``mixed.py --sweep``, each row's ``process``): the CUDA caching allocator's calls into the
driver (``cudaMalloc`` / ``cudaFree``, allocations retried after the cache was freed,
synchronizations of every stream) and Python's garbage collections with their pauses.

They exist to test the explanations of the slow first ~45 s of a fresh process's traffic
(docs/performance.md): a run that pays for new device memory or long collections shows it
here, beside its latencies.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

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

    def __init__(self, device: torch.device, clock=time.perf_counter) -> None:
        self.device, self.clock = device, clock
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
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            for key, name in ALLOCATOR_KEYS.items():
                if key in stats:
                    out[name] = stats[key]
            out["reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
        return out

    def begin(self) -> dict[str, Any]:
        """A snapshot to pass to ``since``; the longest pause counts from here."""
        self.max_pause_s = 0.0
        return self.snapshot()

    def since(self, base: dict[str, Any]) -> dict[str, Any]:
        """The counters' growth since ``base`` (``begin``'s); ``reserved_gib`` as it is now,
        ``gc_max_pause_ms`` the longest pause since ``begin``."""
        now = self.snapshot()
        out = {k: v - base[k] for k, v in now.items() if k in base and k != "reserved_gib"}
        if "reserved_gib" in now:
            out["reserved_gib"] = now["reserved_gib"]
        out["gc_max_pause_ms"] = self.max_pause_s * 1e3
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
