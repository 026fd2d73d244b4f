"""Lane policy and dispatcher tests with a simulated clock and fake (instant) lane work."""

from __future__ import annotations

import pytest
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import SchedulerConfig, SpecConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.runner import PendingStep
from verifypd.lanes.dispatcher import InFlight, LaneDispatcher, choose_lane
from verifypd.types import SamplingParams, StepPlan

ALL = {"decode", "verify", "prefill"}


def test_strict_priority_order():
    work = {"decode": True, "verify": True, "prefill": True}
    assert choose_lane(ALL, work, None, 0.5) == "decode"
    assert choose_lane(ALL - {"decode"}, work, None, 0.5) == "verify"
    assert choose_lane({"prefill"}, work, 0.1, 0.5) == "prefill"
    assert choose_lane(ALL, {"verify": True, "prefill": True}, 0.1, 0.5) == "verify"
    assert choose_lane(ALL, {}, None, 0.5) is None


def test_starved_prefill_jumps_the_queue():
    work = {"decode": True, "verify": True, "prefill": True}
    assert choose_lane(ALL, work, 0.49, 0.5) == "decode"
    assert choose_lane(ALL, work, 0.51, 0.5) == "prefill"
    assert choose_lane(ALL - {"prefill"}, work, 0.51, 0.5) == "decode"  # prefill busy


def test_due_verify_goes_before_decode():
    work = {"decode": True, "verify": True, "prefill": True}
    assert choose_lane(ALL, work, None, 0.5, verify_due=True) == "verify"
    assert choose_lane(ALL, work, 0.51, 0.5, verify_due=True) == "prefill"  # TTFT first
    assert choose_lane(ALL - {"verify"}, work, None, 0.5, verify_due=True) == "decode"


def test_due_prefill_after_another_lanes_step():
    work = {"decode": True, "verify": True, "prefill": True}
    assert choose_lane(ALL, work, None, 0.5, prefill_due=True) == "prefill"
    assert choose_lane(ALL, work, None, 0.5, verify_due=True, prefill_due=True) == "verify"
    assert choose_lane(ALL - {"prefill"}, work, None, 0.5, prefill_due=True) == "decode"
    assert choose_lane(ALL, {"decode": True}, None, 0.5, prefill_due=True) == "decode"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _dispatcher(spec=SpecConfig(), budget=0.5):
    cfg = tiny_config(
        spec=spec,
        scheduler=SchedulerConfig(max_prefill_chunk=8, max_num_batched_tokens=8),
    )
    core = EngineCore(cfg)
    clock = FakeClock()

    async def launch(lane: str, plan: StepPlan) -> PendingStep:
        clock.now += 0.1  # every lane step takes 100 ms of simulated time
        return core.runner.launch(plan)

    outputs = []
    return core, LaneDispatcher(core, launch, outputs.append, budget, clock), clock


def _add(core, rid, n, clock, max_tokens=64):
    seqs = core.add_request(
        rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    for s in seqs:
        s.arrival_time = clock.now


async def _ticks(d, n):
    for _ in range(n):
        await d.tick()


async def test_decode_first_then_prefill_only_when_starved():
    core, d, clock = _dispatcher(budget=0.5)
    _add(core, "a", 4, clock)
    await _ticks(d, 3)
    assert d.launch_log[0] == "prefill" and "decode" in d.launch_log
    _add(core, "b", 40, clock)  # 5 chunks of 8 tokens
    start = len(d.launch_log)
    await _ticks(d, 12)
    log = d.launch_log[start:]
    # b waits while decode keeps the (serial, CPU) engine busy, but never past the budget:
    first_prefill = log.index("prefill")
    assert 0 < first_prefill <= 6  # 0.5 s budget / 0.1 s per step, +1 for the strict >
    assert core.scheduler.waiting == []


async def test_steps_that_land_take_turns_with_prompts():
    """Where a launch returns once its step has run (CPU), a prompt does not wait for the TTFT
    budget behind decode steps, and neither do its later chunks (which the budget, counting
    only waiting prompts, never covered): one decode step, one prompt chunk, in turn."""
    core, d, clock = _dispatcher(budget=60.0)
    d.steps_land = True
    _add(core, "a", 4, clock)
    await _ticks(d, 3)
    _add(core, "b", 40, clock)  # 5 chunks of 8 tokens
    start = len(d.launch_log)
    await _ticks(d, 12)
    log = d.launch_log[start:]
    assert log[:10] == ["prefill", "decode"] * 5, log  # a decode step ran last
    assert not core.scheduler.waiting and not core.scheduler.num_prefilling
    b = next(s for s in core.scheduler.running if s.request_id == "b")
    assert b.output_token_ids  # its first token is out


async def test_single_lane_mode_fuses_everything():
    cfg = tiny_config(lane_mode="single")
    core = EngineCore(cfg)

    async def launch(lane, plan):
        return core.runner.launch(plan)

    d = LaneDispatcher(core, launch, lambda o: None, 0.5, single_lane=True)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    core.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0))
    for _ in range(10):
        await d.tick()
    assert set(d.launch_log) == {"mixed"}
    assert not core.has_unfinished()
    core.check_integrity()


async def test_verify_queue_feeds_the_verify_lane():
    spec = tiny_draft_spec()
    core, d, clock = _dispatcher(spec)
    _add(core, "a", 5, clock, max_tokens=20)
    await _ticks(d, 2)  # prefill; its first token goes out and the tick launches no more
    assert d.launch_log == ["prefill"]
    await d.tick()  # the decode lane drafts and queues a verify
    # the decode lane drafted (no plain decodes left), so the verify lane took the drafts
    assert d.launch_log == ["prefill", "verify"] and d.verify_queue == []
    for _ in range(40):
        await d.tick()
    assert "verify" in d.launch_log
    assert not core.has_unfinished()
    core.check_integrity()


async def test_verify_is_not_starved_by_plain_decodes():
    # On a serial device (CPU) every step lands before the next choice, so the decode lane is
    # always idle; with a plain-decoding neighbour it used to win every time and the drafted
    # sequence waited in the verify queue until the neighbour finished.
    spec = tiny_draft_spec()
    core, d, clock = _dispatcher(spec)
    _add(core, "a", 5, clock, max_tokens=20)
    core.add_request("b", [3, 4, 5], SamplingParams(max_tokens=60, temperature=0, speculate=False))
    await _ticks(d, 8)
    assert "verify" in d.launch_log
    queued = 0
    for _ in range(40):
        await d.tick()
        queued = queued + 1 if d.verify_queue else 0
        assert queued <= 2  # a drafted cohort waits for at most one decode step
    assert not core.has_unfinished()
    core.check_integrity()


async def test_failed_step_ends_requests_and_caches_nothing(tiny_core):
    """A launch that raises ends its requests with "error"; the KV it never wrote must not
    reach the prefix cache (a later request with the same prompt would read garbage)."""
    core = tiny_core

    async def broken(lane: str, plan: StepPlan) -> PendingStep:
        raise RuntimeError("device fell over")

    outputs = []
    d = LaneDispatcher(core, broken, outputs.append, 0.5)
    prompt = list(range(3, 3 + 40))  # two full blocks of 16
    core.add_request("x", prompt, SamplingParams(max_tokens=4, temperature=0))
    await d.tick()
    assert [(o.finished, o.finish_reason) for o in outputs] == [(True, "error")]
    assert core.kv.match_prefix(prompt) == []
    assert core.kv.usage == 0 and not core.has_unfinished()
    core.check_integrity()


@pytest.mark.parametrize("stop,emitted_first", [([], False), (["zzz"], True)])
async def test_deltas_of_a_landed_step_follow_the_next_launch_unless_a_stop_string_waits(
    stop, emitted_first, tiny_core
):
    """With ``emit_after_launch`` (GPU: a launch only enqueues) a landed step's deltas are made
    after the next step is launched, so detokenizing overlaps the GPU; a first token, and a
    request with stop strings (a stopped sequence must never be planned again), go first."""
    core = tiny_core
    events: list[str] = []

    async def launch(lane: str, plan: StepPlan) -> PendingStep:
        events.append(f"launch {lane}")
        return core.runner.launch(plan)

    d = LaneDispatcher(core, launch, lambda out: events.append("delta"), 0.5,
                       emit_after_launch=True)  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, stop=stop)
    core.add_request("r", [5, 6, 7], params)
    for _ in range(6):
        await d.tick()
    # The first token goes out before the next launch (TTFT); later ones after it.
    assert events[:5] == (
        ["launch prefill", "delta", "launch decode", "delta", "launch decode"] if emitted_first
        else ["launch prefill", "delta", "launch decode", "launch decode", "delta"]
    )  # fmt: skip
    assert events.count("delta") == 3 and core.requests == {}
    core.check_integrity()


async def test_deltas_go_first_while_another_lane_keeps_the_gpu_busy(tiny_core):
    """Deferring deltas only pays while the GPU would idle: with another lane's step still in
    flight, ``collect`` delivers at once."""

    class Running:
        def done(self) -> bool:
            return False

    core = tiny_core
    delivered: list = []

    async def launch(lane: str, plan: StepPlan) -> PendingStep:
        return core.runner.launch(plan)

    d = LaneDispatcher(core, launch, delivered.append, 0.5, emit_after_launch=True)
    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    await d.tick()  # launches the prefill (on CPU it has already landed)
    d.in_flight["verify"] = InFlight(StepPlan("verify", []), Running(), 0.0)
    assert d.collect() and len(delivered) == 1  # the prefill's first token, before any launch
    del d.in_flight["verify"]


async def _prefill_steps(pack, backlog=None, waited=0.0):
    cfg = tiny_config(scheduler=SchedulerConfig(max_prefill_chunk=8, max_num_batched_tokens=64,
                                                prefill_pack_tokens=pack,
                                                prefill_pack_backlog_s=backlog))  # fmt: skip
    core = EngineCore(cfg)
    steps: list[list[tuple[str, int]]] = []

    async def launch(lane: str, plan: StepPlan) -> PendingStep:
        if lane == "prefill":
            steps.append([(x.seq.request_id, x.num_new_tokens) for x in plan.seqs])
        return core.runner.launch(plan)

    tokens: dict[str, list[int]] = {"a": [], "b": []}
    clock = FakeClock()
    d = LaneDispatcher(core, launch, lambda o: tokens[o.request_id].extend(o.new_token_ids), 0.5,
                       clock=clock)  # fmt: skip
    _add(core, "a", 12, clock, max_tokens=6)
    await d.tick()  # a's first chunk
    _add(core, "b", 20, clock, max_tokens=6)
    clock.now += waited  # how long b has queued when the lane plans its next step
    for _ in range(100):
        if not core.has_unfinished():
            break
        await d.tick()
    assert not core.has_unfinished()
    core.check_integrity()
    return steps, tokens


async def test_the_prefill_lane_packs_prompts_by_the_config():
    # "a" (12 tokens: chunks 8 + 4) and then "b" (20, long) wait together: with a pack room of
    # 4 a's last chunk runs alone and b heads the next steps; without one they share a step.
    # The tokens are the same either way (each prompt's chunks are the same positions).
    packed, packed_tokens = await _prefill_steps(4)
    fcfs, fcfs_tokens = await _prefill_steps(None)
    assert packed[:3] == [[("a", 8)], [("a", 4)], [("b", 8)]]
    assert fcfs[:2] == [[("a", 8)], [("a", 4), ("b", 8)]]
    assert packed_tokens == fcfs_tokens and all(len(t) == 6 for t in packed_tokens.values())
    # A backlog lifts the room: b queued 0.2 s, past the 0.1 s threshold, joins a's last chunk.
    lifted, lifted_tokens = await _prefill_steps(4, backlog=0.1, waited=0.2)
    assert lifted[:2] == fcfs[:2] and lifted_tokens == fcfs_tokens
    kept, _ = await _prefill_steps(4, backlog=0.1, waited=0.05)  # not yet a backlog
    assert kept[:3] == packed[:3]
