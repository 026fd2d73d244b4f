"""Launching the decode step ahead (``lanes.decode_ahead`` holds its rules and state): the next
decode step planned and launched behind the one in flight, its entries planned ahead of the
host, unless the step after the one in flight speculates. The dispatcher calls
``launch_ahead`` on every tick; it reads and updates the dispatcher's flights, deltas and
failures, as a method of it would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verifypd.lanes.backlog_fuse import fusing
from verifypd.lanes.lane_steps import InFlight
from verifypd.types import NO_SPECULATION, RequestFailure, SeqStatus, StepPlan

if TYPE_CHECKING:
    from verifypd.lanes.dispatcher import LaneDispatcher


async def launch_ahead(d: LaneDispatcher) -> bool:
    """Launches the next decode step behind the one in flight (``decode_ahead``): its entries
    planned ahead of the host (``Scheduler.plan_ahead``), then every decodable sequence not in
    flight. False when there is nothing to launch ahead."""
    head, prompt = d.in_flight.get("decode"), d.in_flight.get("prefill")
    if d.pacing.holds_ahead(d.in_flight):
        return False  # decode steps are spaced out beside it
    if fusing(d):
        return False  # the rows ride in the next prompt step (``lanes.backlog_fuse``)
    if not d.ahead.may_ask(head, prompt, d.core):
        return False
    if d.policy.enabled and speculates_next(d, head):
        return False
    entries = d.sched.plan_ahead(head.plan, head.pending.sampled_at)
    if not entries:
        return False
    entries += d.sched.plan_decode(NO_SPECULATION)
    d.rides.ride(entries)
    plan = StepPlan("decode", entries, prev_ids=head.pending.device_ids)
    d.sched.begin_step(plan)
    d._log_launch("decode")
    d.deltas.drafted_last = False
    d.core.observer.decode_ahead()
    flight = InFlight(plan, None, d.clock(), prompt is not None)
    d.ahead.launched(flight)
    d.pacing.last_launch = flight.start
    try:
        flight.pending = await d._launch_fn("decode", plan)
    except RequestFailure as failure:  # some requests' own inputs: the rest wait
        d.ahead.step = None
        d.sched.abandon(plan)  # nothing of it ran; the others plan again later
        d.failures.end_requests(failure.request_ids)
        return False
    except Exception:
        d.ahead.step = None
        d.failures.fail(plan)
        return False
    return True


def speculates_next(d: LaneDispatcher, head: InFlight) -> bool:
    """The step after ``head`` speculates (a round under way, or the policy decides so for its
    batch now): it waits for its tokens and drafts. The decision is kept for it: a decision
    has side effects (catch-up rounds, probes, the no-gain hold), so it is not asked again when
    that step is planned (asked twice, the second answer lost every catch-up round the first
    one scheduled)."""
    if d.verify_queue or "verify" in d.in_flight:
        return True
    batch = [e.seq for e in head.plan.seqs if e.seq.status is SeqStatus.DECODING]
    batch += d.core.decodable()
    decision = d.policy.decide(d._prefill_signal(), batch)
    if decision.lens:
        d.ahead.keep(decision, batch)
    return bool(decision.lens)
