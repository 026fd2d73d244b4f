"""What holds the event loop: every callback that runs longer than a threshold, named.

asyncio's debug mode times each callback the loop runs (a task's step from one ``await`` to the
next, a timer, a socket read) and logs those longer than the loop's ``slow_callback_duration``
as "Executing <handle> took N seconds". ``SlowCallbacks.install`` turns that on for every loop
created after it (``asyncio.new_event_loop``, as the benchmarks' engines make theirs) and keeps
each such record, with its end time, instead of printing it. ``summary`` groups them by what ran
(a task's coroutine, or a handle's callback).

Debug mode costs the loop time of its own (it checks every call's thread, and tracks where each
coroutine was created): read the run's latencies as a diagnostic's. ``bench/host_diag.py
--slow-callbacks MS`` runs ``bench/mixed.py`` with it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from typing import Any

_EXECUTING = re.compile(r"Executing (.*) took ([0-9.]+) seconds", re.S)
_CORO = re.compile(r"coro=<([\w.<>]+)\(")
_CALLBACK = re.compile(r"<\w*Handle[^>]*?([\w.<>]+)\(")
KEPT = 60  # the slowest callbacks kept with their time


def callback_name(handle: str) -> str:
    """A task's coroutine (``LaneDispatcher._launch_marked``), else a handle's callback, else
    the start of the handle's text."""
    found = _CORO.search(handle) or _CALLBACK.search(handle)
    return found.group(1) if found else handle[:80]


class SlowCallbacks(logging.Handler):
    """Keeps asyncio's slow-callback records of the loops made after ``install``."""

    def __init__(self, seconds: float, clock=time.perf_counter) -> None:
        super().__init__(logging.WARNING)
        self.seconds, self.clock = seconds, clock
        self.calls: list[tuple[float, float, str]] = []  # (end, s, name)
        self._saved: tuple[Any, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        found = _EXECUTING.match(record.getMessage())
        if found:
            self.calls.append((self.clock(), float(found.group(2)), callback_name(found.group(1))))

    def install(self) -> None:
        """Loops made from now on run in debug mode with this threshold; asyncio's records go
        here only (``uninstall`` undoes both)."""
        logger = logging.getLogger("asyncio")
        self._saved = (asyncio.new_event_loop, logger.propagate)
        make, seconds = asyncio.new_event_loop, self.seconds

        def new_event_loop() -> asyncio.AbstractEventLoop:
            loop = make()
            loop.set_debug(True)
            loop.slow_callback_duration = seconds
            return loop

        asyncio.new_event_loop = new_event_loop
        logger.addHandler(self)
        logger.propagate = False

    def uninstall(self) -> None:
        if self._saved is None:
            return
        logger = logging.getLogger("asyncio")
        asyncio.new_event_loop, logger.propagate = self._saved
        logger.removeHandler(self)
        self._saved = None

    def summary(self) -> dict[str, Any]:
        """Per callback name: how often it held the loop past the threshold, for how long in
        all and at most; and the slowest ``KEPT`` in order, in ms from the first record."""
        by: dict[str, list[float]] = collections.defaultdict(list)
        for _, s, name in self.calls:
            by[name].append(s * 1e3)
        start = self.calls[0][0] if self.calls else 0.0
        slowest = sorted(self.calls, key=lambda c: -c[1])[:KEPT]
        return {
            "threshold_ms": self.seconds * 1e3,
            "by_callback": {
                name: {"count": len(ms), "total_ms": round(sum(ms), 1), "max_ms": round(max(ms), 2)}
                for name, ms in sorted(by.items(), key=lambda kv: -sum(kv[1]))
            },
            "slowest": [
                {"end_ms": round((end - start) * 1e3, 1), "ms": round(s * 1e3, 2), "name": name}
                for end, s, name in sorted(slowest)
            ],
        }
