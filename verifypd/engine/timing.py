"""Timing of enqueued work without host syncs."""

from __future__ import annotations

import time

import torch


class Span:
    """How long the work enqueued between ``Span(...)`` and ``stop()`` took to run.

    On a GPU it is the time between two CUDA events on the current stream, known once the GPU
    has reached the second (``seconds()`` returns None before that, and never blocks); on the
    CPU, where the work runs while it is enqueued, it is wall time.
    """

    def __init__(self, cuda: bool) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._wall: float | None = None
        if cuda:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        self._t0 = time.perf_counter()

    def stop(self) -> Span:
        if self._events is not None:
            self._events[1].record()
        else:
            self._wall = time.perf_counter() - self._t0
        return self

    def seconds(self) -> float | None:
        if self._events is None:
            return self._wall
        start, end = self._events
        if not end.query():
            return None
        return start.elapsed_time(end) / 1e3
