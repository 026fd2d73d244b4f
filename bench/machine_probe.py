"""What the machine did during a sweep run, beside what the process did
(``process_counters.ProcessCounters`` records both in each row's ``process``): the host's CPU
busy and stolen shares (``/proc/stat``: a virtual machine whose CPUs another tenant takes shows
steal) and the GPU's SM clock and clock-throttle reasons, sampled on a thread (NVML through
ctypes; nothing where the library or a GPU is missing).

They exist for the runs that came out slow for no reason the engine shows: on two of four
freshly started H200s (86dff23, 61fca9e) the first mode ran its tokens 20-60 % slower than the
same mode later in the lease (docs/performance.md).

Throttle reasons (NVML's bits, OR-ed over the run): 0x1 idle, 0x2 application clocks, 0x4
software power cap, 0x8 hardware slowdown, 0x20 sync boost, 0x40 software thermal, 0x80
hardware thermal, 0x100 hardware power brake, 0x200 display clocks.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

NVML_CLOCK_SM = 1
Reading = tuple[int, int]  # (SM clock MHz, throttle reasons)


def host_cpu_ticks(path: str = "/proc/stat") -> tuple[int, int, int] | None:
    """(all, idle + iowait, steal) ticks of every CPU since boot (Linux), or None."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 6 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    steal = ticks[7] if len(ticks) > 7 else 0
    return sum(ticks), ticks[3] + ticks[4], steal


def host_shares(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, float]:
    """The host's CPU busy and stolen shares between two ``host_cpu_ticks`` readings."""
    total = after[0] - before[0]
    if total <= 0:
        return {}
    idle, steal = after[1] - before[1], after[2] - before[2]
    return {"host_busy_share": 1.0 - idle / total, "host_steal_share": steal / total}


def nvml_reader(index: int = 0) -> Callable[[], Reading | None] | None:
    """A callable reading GPU ``index``'s (SM clock MHz, throttle reasons) through NVML, or
    None where NVML or the GPU is not there."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        get_clock = lib.nvmlDeviceGetClockInfo
        get_reasons = lib.nvmlDeviceGetCurrentClocksThrottleReasons
        if lib.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError):  # no library, or a symbol it lacks
        return None

    def read() -> Reading | None:
        clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        if get_clock(handle, NVML_CLOCK_SM, ctypes.byref(clock)) != 0:
            return None
        if get_reasons(handle, ctypes.byref(reasons)) != 0:
            return None
        return clock.value, reasons.value

    return read


class GpuClocks:
    """``read`` (``nvml_reader``'s) every ``interval_s`` on a daemon thread from ``start`` to
    ``stop``, which returns the run's SM clock (least, mean) and throttle reasons."""

    def __init__(self, read: Callable[[], Reading | None], interval_s: float = 0.5) -> None:
        self.read, self.interval_s = read, interval_s
        self._samples: list[Reading] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.stop()
        self._samples, self._done = [], threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-clocks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            reading = self.read()
            if reading is not None:
                self._samples.append(reading)
            if self._done.wait(self.interval_s):
                return

    def stop(self) -> dict[str, float | int]:
        if self._thread is None:
            return {}
        self._done.set()
        self._thread.join()
        self._thread = None
        if not self._samples:
            return {}
        clocks = [c for c, _ in self._samples]
        reasons = 0
        for _, r in self._samples:
            reasons |= r
        return {"sm_clock_min_mhz": min(clocks), "sm_clock_mean_mhz": sum(clocks) / len(clocks),
                "throttle_reasons": reasons, "clock_samples": len(clocks)}  # fmt: skip
