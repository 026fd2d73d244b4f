"""Timing of enqueued work without host syncs, and the kind of step the cost model files a
landed step's time under."""

from __future__ import annotations

import time

import torch

from verifypd.types import SeqStatus, StepPlan


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


def step_cost_kind(plan: StepPlan) -> str | None:
    """The cost model's kind of a landed step: prefill, decode (one token a row), verify (the
    same 1 + L a row) or mixed (rows of different lengths, no prompt chunk); None for a fused
    single-lane step carrying prompt chunks (its time says little about either)."""
    if plan.lane == "prefill":
        return "prefill"
    widths = set()
    for e in plan.seqs:
        if e.seq.status is SeqStatus.PREFILLING:
            return None
        widths.add(len(e.draft_token_ids))
    if len(widths) > 1:
        return "mixed"
    return "verify" if widths and widths != {0} else "decode"
