"""Scheduler tests on CPU with a real KVCacheManager and no model: exact block ids and counts."""

from __future__ import annotations

import pytest

from verifypd.engine.scheduler import Scheduler
from verifypd.kvcache import KVCacheManager
from verifypd.types import SamplingParams, SeqStatus, Sequence, StepPlan


def _sched(num_blocks=16, block_size=4, budget=64, chunk=64, max_seqs=8, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(
        kv,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_prefill_chunk=chunk,
        max_model_len=1024,
        eos_token_ids=[0],
    )


def _seq(n, rid="r", prio=0, t=0.0, max_tokens=8, start=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=prio)
    return Sequence(rid, list(range(start, start + n)), params, arrival_time=t)


def _run(s: Scheduler, plan: StepPlan, tok: int = 7) -> None:
    """Pretend-execute: every sampling seq gets token ``tok``."""
    s.begin_step(plan)
    s.update(plan, [[tok] if x.samples else [] for x in plan.seqs])


def test_prefill_then_decode_exact_blocks():
    s = _sched()
    a = _seq(6)
    s.add(a)
    plan = s.schedule_mixed()
    assert [(x.seq, x.num_new_tokens) for x in plan.seqs] == [(a, 6)]
    assert a.block_table == [0, 1]
    _run(s, plan)
    assert a.status is SeqStatus.DECODING and a.num_computed_tokens == 6
    assert a.token_ids[-1] == 7
    plan = s.schedule_mixed()
    assert [(x.seq, x.num_new_tokens) for x in plan.seqs] == [(a, 1)]
    _run(s, plan)
    _run(s, s.schedule_mixed())  # fed positions 6 and 7: still two blocks
    assert a.block_table == [0, 1]
    _run(s, s.schedule_mixed())  # position 8 needs a third block
    assert a.block_table == [0, 1, 2]
    s.kv.check_integrity(s.live_tables())


def test_chunked_prefill_respects_budget_and_decodes_first():
    s = _sched(budget=5, chunk=3)
    a, b = _seq(2, "a", t=0), _seq(10, "b", t=1)
    s.add(a)
    _run(s, s.schedule_mixed())  # a prefilled
    s.add(b)
    plan = s.schedule_mixed()
    assert [(x.seq.request_id, x.num_new_tokens) for x in plan.seqs] == [("a", 1), ("b", 3)]
    _run(s, plan)
    assert b.num_computed_tokens == 3 and b.status is SeqStatus.PREFILLING
    while b.status is SeqStatus.PREFILLING:
        _run(s, s.schedule_mixed())
    assert b.num_computed_tokens == 10 and b.num_output_tokens == 1


def test_priority_admission_order():
    s = _sched(max_seqs=1)
    low, high = _seq(3, "low", prio=0, t=0), _seq(3, "high", prio=5, t=1)
    s.add(low)
    s.add(high)
    plan = s.schedule_mixed()
    assert [x.seq.request_id for x in plan.seqs] == ["high"]


def test_prefix_hit_reuses_exact_blocks():
    s = _sched()
    a = _seq(9, "a", max_tokens=1)
    s.add(a)
    _run(s, s.schedule_mixed())  # finishes at max_tokens=1; full blocks 0, 1 cached
    assert a.status is SeqStatus.FINISHED and s.kv.usage == 0
    b = _seq(9, "b", max_tokens=1)
    s.add(b)
    plan = s.schedule_mixed()
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 8
    assert plan.seqs[0].num_new_tokens == 1  # only the last token is computed


def test_preemption_frees_newest_lowest_priority():
    s = _sched(num_blocks=4, block_size=4, prefix=False)
    old, new = _seq(7, "old", t=0, max_tokens=20), _seq(7, "new", t=1, max_tokens=20)
    s.add(old)
    s.add(new)
    _run(s, s.schedule_mixed())  # both prefilled: 2 blocks each, pool full
    assert s.kv.num_free_blocks == 0
    _run(s, s.schedule_mixed())  # position 7 fits in block 2 for both
    plan = s.schedule_mixed()  # position 8 needs a new block: "new" is preempted for "old"
    assert [x.seq.request_id for x in plan.seqs] == ["old"]
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert s.waiting == [new] and s.num_preemptions == 1
    s.kv.check_integrity(s.live_tables())


def test_abort_in_flight_defers_free():
    s = _sched()
    a = _seq(5)
    s.add(a)
    plan = s.schedule_mixed()
    s.begin_step(plan)
    s.finish(a, "abort")
    assert a.block_table != []  # blocks still being written by the in-flight step
    s.update(plan, [[7]])
    assert a.block_table == [] and s.kv.usage == 0
    assert a.status is SeqStatus.ABORTED and a.num_output_tokens == 0
    s.kv.check_integrity([])


def test_stop_conditions():
    s = _sched()
    a = _seq(3, max_tokens=2)
    s.add(a)
    _run(s, s.schedule_mixed())
    _run(s, s.schedule_mixed(), tok=0)  # eos id 0
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "stop"
    b = _seq(3, "b", max_tokens=2)
    s.add(b)
    _run(s, s.schedule_mixed())
    _run(s, s.schedule_mixed())
    assert b.finish_reason == "length" and b.num_output_tokens == 2
    assert s.kv.usage == 0


def _chunks(plan_entries) -> list[tuple[str, int]]:
    return [(x.seq.request_id, x.num_new_tokens) for x in plan_entries]


def _land(s: Scheduler, entries) -> None:
    _run(s, StepPlan("prefill", entries))


def test_a_prompts_last_chunk_does_not_wait_for_the_next_long_prompt():
    # "a" needs two chunks; "b" (long) arrives before a's second: unpacked, a's last chunk
    # would share its step with b's first 8 tokens and a's first token would wait for both.
    s = _sched(num_blocks=64, budget=64, chunk=8)
    a, b = _seq(12, "a", t=0), _seq(20, "b", t=1, start=100)
    s.add(a)
    _land(s, s.plan_prefill(64, 8, pack=4))
    s.add(b)
    step = s.plan_prefill(64, 8, pack=4)
    assert _chunks(step) == [("a", 4)]  # b's 8 do not end b: b heads the next step
    _land(s, step)
    assert a.status is SeqStatus.DECODING and b.status is SeqStatus.WAITING
    assert _chunks(s.plan_prefill(64, 8, pack=4)) == [("b", 8)]
    s.kv.check_integrity(s.live_tables())


def test_without_a_pack_limit_every_chunk_packs_fcfs():
    s = _sched(num_blocks=64, budget=64, chunk=8)
    a, b = _seq(12, "a", t=0), _seq(20, "b", t=1, start=100)
    s.add(a)
    _land(s, s.plan_prefill(64, 8))
    s.add(b)
    assert _chunks(s.plan_prefill(64, 8)) == [("a", 4), ("b", 8)]


def test_short_prompts_ride_along_within_the_pack_room_and_later_ones_head_steps():
    # FCFS: long "a" (its first chunk heads the step), then "b" (3 tokens: rides), "c" (too long
    # to ride: skipped, not cut), "d" and "e" (2 each: d rides, e would pass the room of 5).
    s = _sched(num_blocks=64, budget=64, chunk=8)
    seqs = [
        _seq(n, rid, t=i, start=10 * i + 1)
        for i, (rid, n) in enumerate([("a", 20), ("b", 3), ("c", 6), ("d", 2), ("e", 2)])
    ]
    for q in seqs:
        s.add(q)
    step = s.plan_prefill(64, 8, pack=5)
    assert _chunks(step) == [("a", 8), ("b", 3), ("d", 2)]
    assert [q.request_id for q in s.waiting] == ["c", "e"]  # order kept for the next steps
    _land(s, step)
    # a's next chunk (8 of 12 left) heads; c (6) is too long to ride a room of 5; e rides
    assert _chunks(s.plan_prefill(64, 8, pack=5)) == [("a", 8), ("e", 2)]
    s.kv.check_integrity(s.live_tables())


def test_a_prompt_at_the_head_is_never_held_back_by_the_pack_limit():
    s = _sched(num_blocks=64, budget=64, chunk=8)
    s.add(_seq(30, "long"))
    assert _chunks(s.plan_prefill(64, 8, pack=0)) == [("long", 8)]


def test_the_pack_limit_keeps_the_budget_and_the_running_cap():
    s = _sched(num_blocks=64, budget=64, chunk=8, max_seqs=2)
    for i in range(4):
        s.add(_seq(2, f"r{i}", t=i, start=10 * i + 1))
    assert _chunks(s.plan_prefill(64, 2, pack=8)) == [("r0", 2), ("r1", 2)]
    s2 = _sched(num_blocks=64, budget=64, chunk=8)
    for i in range(4):
        s2.add(_seq(2, f"r{i}", t=i, start=10 * i + 1))
    assert _chunks(s2.plan_prefill(5, 8, pack=8)) == [("r0", 2), ("r1", 2)]  # 1 left: none fit


def test_a_backlog_lifts_the_pack_limit():
    # a heads the step; b and c (not ending within the room) would each head a later step,
    # unless the oldest queued prompt has waited past the backlog threshold.
    s = _sched(num_blocks=64, budget=64, chunk=8)
    s.prefill_pack_tokens, s.prefill_pack_backlog_s = 2, 0.1
    for i, (rid, n) in enumerate([("a", 8), ("b", 6), ("c", 6)]):
        s.add(_seq(n, rid, t=10.0 + 0.01 * i, start=10 * i + 1))
    assert s.prefill_pack(now=10.05) == 2  # a waited 50 ms: not a backlog
    assert s.prefill_pack(now=10.2) is None  # 200 ms: pack FCFS to the budget
    step = s.plan_prefill(64, 8, s.prefill_pack(now=10.2))
    assert _chunks(step) == [("a", 8), ("b", 6), ("c", 6)]
    assert s.prefill_pack(now=99.0) == 2  # nothing queued: the limit again
    s.prefill_pack_backlog_s = None
    s.add(_seq(4, "d", t=0.0, start=90))
    assert s.prefill_pack(now=99.0) == 2  # never lifted


def test_the_pack_limit_is_validated():
    from verifypd.config import SchedulerConfig

    assert SchedulerConfig().prefill_pack_tokens == 512  # the default, with 4,096 chunks
    assert SchedulerConfig().max_prefill_chunk == 4096
    assert SchedulerConfig(prefill_pack_tokens=None).prefill_pack_tokens is None  # FCFS
    for bad in (-1, 1.5, "512"):
        with pytest.raises(ValueError, match="prefill_pack_tokens"):
            SchedulerConfig(prefill_pack_tokens=bad)
    assert SchedulerConfig().prefill_pack_backlog_s is None
    assert SchedulerConfig(prefill_pack_backlog_s=0).prefill_pack_backlog_s == 0
    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="prefill_pack_backlog_s"):
            SchedulerConfig(prefill_pack_backlog_s=bad)


def test_prompts_waiting_counts_queued_and_part_prefilled_prompts_not_in_flight():
    s = _sched(chunk=4)
    assert not s.prompts_waiting() and s.num_prefilling == 0
    a = _seq(10, "a")
    s.add(a)
    assert s.prompts_waiting() and s.num_prefilling == 0  # queued
    plan = StepPlan("prefill", s.plan_prefill(64, 8))  # admitted: its first chunk of 4
    assert s.num_prefilling == 1 and s.prompts_waiting()  # planned, not yet in flight
    s.begin_step(plan)
    assert s.num_prefilling == 0 and not s.prompts_waiting()  # in flight: nothing waits
    s.update(plan, [[] for _ in plan.seqs])
    assert a.status is SeqStatus.PREFILLING and s.num_prefilling == 1 and s.prompts_waiting()
