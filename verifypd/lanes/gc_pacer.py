"""Garbage collection while serving, paced to the step loop (``EngineConfig.gc_serving``).

CPython collects its young generations whenever allocations cross a threshold, wherever the
host happens to be: in the middle of planning or launching a step too. On a GPU a collection
there is a pause the device waits through: a generation-1 collection of the serving heap takes
2-4 ms (H200 host, 2 req/s, bench/host_diag.py), most of a 7B decode step, so every row of the
step it lands in gets a late token.

``idle`` moves the collections to where the host would otherwise wait: the automatic collector
is off while the engine serves, and the loop runs the collections that are due when it polls
for a step to land right after it made progress (a step was launched or folded back in, so the
GPU has a queued step to run meanwhile); the full one only when no step is in flight, or once
it is ``OVERDUE`` times its threshold. A loop that never waits still collects once its young
allocations reach ``OVERDUE`` thresholds. ``auto`` leaves CPython's collector as it is (the
default); ``off`` never collects while serving (benchmarks only: the upper bound of what pacing
can give; cyclic garbage grows until the engine stops).
"""

from __future__ import annotations

import gc

from verifypd.config import GC_MODES

OVERDUE = 8  # young thresholds past due: a loop that never waits collects anyway


class GcPacer:
    """Runs the collector's due collections at the step loop's waits (module docstring)."""

    def __init__(self, mode: str) -> None:
        if mode not in GC_MODES:
            raise ValueError(f"gc_serving must be one of {GC_MODES}, got {mode!r}")
        self.mode = mode
        self.collections = [0, 0, 0]  # by generation, while paced (tests, diagnostics)
        self._was_enabled: bool | None = None

    @property
    def paced(self) -> bool:
        return self._was_enabled is not None

    def start(self) -> None:
        """Turns the automatic collector off (``idle``, ``off``); process-wide until ``stop``."""
        if self.mode == "auto" or self.paced:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()

    def stop(self) -> None:
        """Gives the automatic collector back as it was before ``start``."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def waiting(self, after_progress: bool, in_flight: bool) -> None:
        """The loop waits for the GPU: ``after_progress``, right after a launch or a fold (a
        queued step runs meanwhile); ``in_flight`` False, nothing runs at all."""
        if self.mode != "idle" or not self.paced:
            return
        if not in_flight:
            self._collect(full=True)
        elif after_progress:
            self._collect(full=False)

    def busy(self) -> None:
        """The loop made progress without waiting: collects only what is long overdue."""
        if self.mode == "idle" and self.paced and gc.get_count()[0] >= OVERDUE * _threshold(0):
            self._collect(full=False)

    def _collect(self, full: bool) -> None:
        """The collection CPython would run now (the oldest generation whose count reached its
        threshold; the full one only where ``full`` or long overdue), or none while young
        allocations are below the first threshold."""
        young, gen1, gen2 = gc.get_count()
        if young < _threshold(0):
            return
        gen = 0
        if gen2 >= _threshold(2) and (full or gen2 >= OVERDUE * _threshold(2)):
            gen = 2
        elif gen1 >= _threshold(1):
            gen = 1
        gc.collect(gen)
        self.collections[gen] += 1


def _threshold(gen: int) -> int:
    return max(1, gc.get_threshold()[gen])
