"""Decode rows inside prompt steps during a prompt backlog (``EngineConfig.fuse_decode_backlog_s``).

Beside a prompt step a decode step takes SMs for its own weight reads, so a burst of prompts
computes slower while decode runs on its stream. While the oldest queued prompt has waited
longer than the setting (and, with ``fuse_decode_backlog_tokens``, the queue holds that many
prompt tokens), the decode lane leaves its rows to the prefill lane, whose next step
computes them together with the prompt chunks in one forward (a ``"mixed"`` plan, plain: no
drafts), as vLLM runs every step. A decode step already in flight lands first; its rows ride in
the step after it. Speculation resumes with the decode lane once the backlog is gone. Such a
step's time is not a decode step's: the policy's latency guard and cost model skip it
(``StepPlan.carries_prompt``).

With ``EngineConfig.fuse_rounds_rows`` the rows also ride under load, not only in a backlog:
while that many rows decode and a prompt waits for a prompt step (``rounds_ride``). Every fused
step then carries drafts, verified inside it (``"mixed"`` with drafts, as the single lane runs
every step; the goodput policy's rows draft L_max there): three lanes while the batch is small,
one fused step a round beside prompts once it is not.

The dispatcher calls these as it would its own methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from verifypd.types import NO_SPECULATION, SeqStatus, Sequence, StepPlan

if TYPE_CHECKING:
    from verifypd.engine.scheduler import Scheduler
    from verifypd.lanes.dispatcher import LaneDispatcher


def fusing(d: LaneDispatcher) -> bool:
    """A backlog: the oldest queued prompt has waited longer than the setting, the queue holds
    at least ``fuse_decode_backlog_tokens`` prompt tokens, and there is room to admit the first
    in the queue (a row free, KV blocks for its first chunk): else a fused step would carry
    decode rows alone, on the prefill lane's eager path. With ``fuse_decode_hold_tokens``, once
    a fused step was planned the backlog lasts, without the wait, while the queue holds that
    many tokens; the hold ends with the first check that finds no backlog."""
    if rounds_ride(d):
        return True
    limit, sched = d.fuse_decode_backlog_s, d.sched
    if limit is None or not sched.waiting or sched.num_running >= sched.max_num_seqs:
        d.fuse_held = False
        return False
    hold = d.fuse_decode_hold_tokens
    if d.fuse_held and hold is not None and queued_at_least(sched.waiting, hold) and _room(sched):
        return True
    wait = d._prefill_wait()
    backlog = (
        wait is not None and wait > limit
        and queued_at_least(sched.waiting, d.fuse_decode_backlog_tokens) and _room(sched)
    )  # fmt: skip
    d.fuse_held = d.fuse_held and backlog
    return backlog


def rounds_ride(d: LaneDispatcher) -> bool:
    """Load (``fuse_rounds_rows``): at least that many rows decode (in a step or not) and a
    prompt waits for a prompt step: a part-prefilled one's next chunk, or a queued one with
    room to admit it."""
    least, sched = d.fuse_rounds_rows, d.sched
    if least is None or not sched.prompts_waiting():
        return False
    if sched.num_prefilling == 0:  # then one is queued: admitting it needs a row and blocks
        if sched.num_running >= sched.max_num_seqs or not _room(sched):
            return False
    rows = 0
    for seq in sched.running:
        rows += seq.status is not SeqStatus.PREFILLING
        if rows >= least:
            return True
    return False


def _room(sched: Scheduler) -> bool:
    """KV blocks for the first queued prompt's first chunk."""
    first = min(sched.waiting[0].num_tokens, sched.max_prefill_chunk)
    return -(-first // sched.kv.block_size) <= sched.kv.num_free_blocks


def queued_at_least(waiting: Iterable[Sequence], tokens: int) -> bool:
    """The queued sequences hold at least ``tokens`` tokens still to compute (stops counting
    there: a long queue costs no more than the prompts it takes)."""
    total = 0
    for seq in waiting:
        if total >= tokens:
            break
        total += seq.num_tokens - seq.num_computed_tokens
    return total >= tokens


def decode_yields(d: LaneDispatcher) -> bool:
    """The decode lane leaves its rows to the next prompt step: a backlog, and no prompt step
    in flight (beside one, rows not in it decode as usual)."""
    return "prefill" not in d.in_flight and fusing(d)


def plan_fused(d: LaneDispatcher) -> StepPlan | None:
    """The prefill lane's step in a backlog: every decodable row (with the policy's drafts
    under ``fuse_rounds_rows``, ``SpeculationPolicy.in_prompt_step``), then the prompt
    chunks the rest of the budget holds (the usual packing rule). None while a decode step
    is in flight or launched ahead: its rows land first."""
    if "decode" in d.in_flight or d.ahead.step is not None:
        return None
    sched, decision = d.sched, NO_SPECULATION
    if d.fuse_rounds_rows is not None:  # the policy's drafts ride too
        rows = d.core.decodable()
        decision = d.ahead.take_decision(rows)
        decision = d.policy.decide() if decision is None else decision
        decision = d.policy.in_prompt_step(decision, rows)
        if d._delivers_first(decision):
            return None
    plan = sched.schedule_mixed(decision, d.core.prefill_budget(), sched.prefill_pack(d.clock()))
    if plan is None:
        return None
    plan.in_prompt_step = True
    d.fuse_held = True
    rows = sum(1 for e in plan.seqs if e.seq.status is not SeqStatus.PREFILLING)
    if rows:
        d.core.observer.decode_fused(rows)
    return plan
