"""Prompt-ahead (``EngineConfig.prompt_ahead``): the next prompt step planned and launched behind
the one in flight, on the prefill lane's stream.

Between two prompt steps the GPU waits for the host: the step's fold-back, the next plan, its
input upload and its first layers' launches. On an H200 (dummy 7B, ``bench/burst.py --trace``,
a burst of six prompts with nothing decoding, f1cbf6c) that was 1.4-2.0 ms at each step's end
and ~1 ms of short gaps while the next step's first layers were enqueued: 14 ms of the burst's
209 ms on the GPU. Launched while the step before it runs, the next step starts on the GPU as
that one ends, and its fold-back overlaps the step after.

The step ahead takes only prompts the one in flight does not hold (the scheduler counts a
prompt's computed tokens when its chunk lands: a long prompt's next chunk waits for its chunk
in flight). None goes ahead while decode rows are to ride in the next prompt step (a backlog,
``lanes.backlog_fuse``, with rows decoding), the next prompt is left to a decode step
(``lanes.prompt_rides``), or the next queued prompt begins with a block a prompt in flight
begins with: its blocks enter the prefix cache when that step lands, and planned after it the
prompt reuses them. When the step in flight lands, the one ahead moves up in its place.

The dispatcher calls these as it would its own methods.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from verifypd.lanes.backlog_fuse import fusing
from verifypd.lanes.lane_steps import InFlight
from verifypd.types import RequestFailure, SeqStatus, StepPlan

if TYPE_CHECKING:
    from verifypd.lanes.dispatcher import LaneDispatcher


_DECODE_STATES = (SeqStatus.DECODING, SeqStatus.VERIFYING)


def prompt_ahead_on(field: bool | None, enqueues: bool) -> bool:
    """``EngineConfig.prompt_ahead``: None is on where a launch only enqueues (a GPU)."""
    return enqueues if field is None else field


class PromptAhead:
    """The prompt step launched behind the one in flight, if any."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.step: InFlight | None = None
        self.num_steps = 0  # prompt steps launched ahead (tests, benchmarks)

    def move_up(self) -> InFlight | None:
        flight, self.step = self.step, None
        return flight


async def launch_prompt_ahead(d: LaneDispatcher) -> bool:
    """Plans the next prompt step behind the one in flight and starts its launch (a task, in
    pieces, as the prefill lane's); False when none goes ahead now."""
    ahead, head = d.prompt_ahead, d.in_flight.get("prefill")
    if not ahead.enabled or ahead.step is not None or head is None or head.pending is None:
        return False  # (a launch still being enqueued: the next one waits for it)
    sched = d.sched
    if not sched.prompts_waiting() or d._prompt_waits_for_decode():
        return False
    if fusing(d) and any(s.status in _DECODE_STATES for s in sched.running):
        return False  # the decode rows ride in the next prompt step
    if _shares_first_block(d, head):
        return False
    pack = sched.prefill_pack(d.clock())
    entries = sched.plan_prefill(d.core.prefill_budget(), sched.max_num_seqs, pack)
    if not entries:
        return False
    plan = StepPlan("prefill", entries)
    sched.begin_step(plan)
    d._log_launch("prefill")
    for f in d.flights():  # it will share the GPU with them (not with the step it runs behind)
        if f is not head:
            f.contended = True
    flight = ahead.step = InFlight(plan, None, d.clock())
    ahead.num_steps += 1
    d.core.observer.prompt_ahead()
    task = asyncio.create_task(_finish(d, plan, flight))
    d._launches.add(task)
    task.add_done_callback(d._launches.discard)
    return True


def _shares_first_block(d: LaneDispatcher, head: InFlight, look: int = 8) -> bool:
    """One of the first ``look`` queued prompts begins with the same block (and cache salt) as
    a prompt whose chunk is in flight (prefix caching on): the prefix it would reuse is not
    cached yet."""
    kv = d.core.kv
    if not kv.enable_prefix_caching:
        return False
    bs = kv.block_size
    firsts = {(tuple(e.seq.token_ids[:bs]), e.seq.params.cache_salt) for e in head.plan.seqs
              if len(e.seq.token_ids) > bs}  # fmt: skip
    return any((tuple(s.token_ids[:bs]), s.params.cache_salt) in firsts
               for s in d.sched.waiting[:look] if len(s.token_ids) > bs)  # fmt: skip


async def _finish(d: LaneDispatcher, plan: StepPlan, flight: InFlight) -> None:
    try:
        flight.pending = await d._launch_fn("prefill", plan)
    except RequestFailure as failure:  # some requests' own inputs: the rest plan again
        _drop(d, flight)
        d.sched.abandon(plan)
        d.failures.end_requests(failure.request_ids)
    except Exception:
        _drop(d, flight)
        d.failures.fail(plan)


def _drop(d: LaneDispatcher, flight: InFlight) -> None:
    """A launch ahead that failed leaves the flights: ahead, or moved up already."""
    if d.prompt_ahead.step is flight:
        d.prompt_ahead.step = None
    elif d.in_flight.get("prefill") is flight:
        del d.in_flight["prefill"]


def move_up(d: LaneDispatcher) -> None:
    """The prompt step in flight has landed: the one ahead takes its place (its time counted
    from now: it ran behind the one folded), or is folded in too if it has landed as well."""
    flight = d.prompt_ahead.move_up()
    if flight is None:
        return
    flight.start = max(flight.start, d.clock())
    if flight.pending is not None and flight.pending.done():
        d._fold(flight, None)
    else:
        d.in_flight["prefill"] = flight
