"""Scheduler tests on CPU with a real KVCacheManager and no model: exact block ids and counts."""

from __future__ import annotations

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
