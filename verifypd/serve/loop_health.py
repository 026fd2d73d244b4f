"""How long the server's event loop could not answer: its lag and the garbage collector's pauses.

The engine and the HTTP front share one event loop (``engine_client``): a request's bytes wait
while the loop runs an engine step's host work, another stream's chunks, or a collection. Two
histograms show it from outside: ``verifypd_event_loop_lag_seconds`` (a task that sleeps
``PROBE_INTERVAL_S`` observes how late it wakes) and ``verifypd_gc_pause_seconds{generation}``
(``gc.callbacks``: every collection of the process, timed). A TTFT that the client sees far above
the engine's own ``time_to_first_token_seconds`` with a long lag tail is this loop's doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

PROBE_INTERVAL_S = 0.01


class GcTimer:
    """Times every garbage collection (``gc.callbacks``) and reports (generation, seconds)."""

    def __init__(self, report: Callable[[int, float], None]) -> None:
        self.report = report
        self._start: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.report(int(info.get("generation", 0)), time.perf_counter() - self._start)
            self._start = None

    def install(self) -> None:
        gc.callbacks.append(self)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)


async def probe_lag(report: Callable[[float], None], interval_s: float = PROBE_INTERVAL_S) -> None:
    """Forever: sleep ``interval_s`` and report how much later than asked the loop woke."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        report(max(0.0, loop.time() - asked))


def add_loop_health(app: web.Application, observer: Any) -> None:
    """Run the lag probe and the GC timer while ``app`` runs, reporting to ``observer``
    (``PrometheusObserver.loop_lag`` / ``gc_pause``)."""

    async def _probe(app: web.Application) -> AsyncIterator[None]:
        timer = GcTimer(observer.gc_pause)
        timer.install()
        task = asyncio.create_task(probe_lag(observer.loop_lag))
        yield
        task.cancel()
        timer.remove()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(_probe)
