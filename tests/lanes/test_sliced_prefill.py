"""Prompt steps enqueued in pieces (``EngineConfig.prefill_slice_layers``): the runner's
launch pauses between layer groups, and the dispatcher runs such a launch as a task of its own,
so decode steps launch and land while a prompt step is still being enqueued. Same tokens as a
launch in one piece; failures part-way end only their requests and leak nothing. The drafter's
forward behind a prompt step (``SpecConfig.follow_prefill``) is enqueued in pieces too."""

from __future__ import annotations

import asyncio

import pytest
from helpers import pin_costs, tiny_config, tiny_draft_spec

from verifypd.config import SchedulerConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.model import drain
from verifypd.engine.speculative import DraftView
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.lanes.executor import LaneStreams, StreamExecutor, executor_for
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.types import Observer, RequestFailure, SamplingParams, ScheduledSeq, StepPlan

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)


def _core(slice_layers: int = 1) -> EngineCore:
    sched = SchedulerConfig(max_prefill_chunk=64, max_num_batched_tokens=64)
    return EngineCore(tiny_config(scheduler=sched, prefill_slice_layers=slice_layers))


def _prompt_plan(core: EngineCore, rid: str, n: int) -> StepPlan:
    (seq,) = core.add_request(rid, list(range(3, 3 + n)), GREEDY)
    assert core.kv.allocate(seq.block_table, n)
    return StepPlan("prefill", [ScheduledSeq(seq, n)])


def test_launch_iter_pauses_between_layer_groups_and_matches_launch() -> None:
    core = _core()
    layers = len(core.runner.model.layers)
    assert layers == 2
    plan = _prompt_plan(core, "a", 20)
    whole = core.launch(plan).result()
    pieces = core.launch_iter(plan, 1)
    pauses = 0
    while True:
        try:
            next(pieces)
            pauses += 1
        except StopIteration as stop:
            sliced = stop.value.result()
            break
    assert pauses == layers - 1 and sliced == whole and whole[0]
    assert drain(core.launch_iter(plan, 0)).result() == whole  # 0: one piece, no pause


def test_prefill_slice_layers_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill_slice_layers"):
        tiny_config(prefill_slice_layers=-1)
    core = _core(0)
    assert StreamExecutor(
        core, SpeculationPolicy(core), LaneStreams(core.device)
    ).background_lanes == (frozenset())
    # On CPU a launch runs in a worker thread, whole: nothing launches in the background.
    assert executor_for(_core(), SpeculationPolicy(core), ()).background_lanes == frozenset()


def _dispatcher(core: EngineCore, outputs: list):
    """A dispatcher launching through the GPU executor (on CPU: no streams, each piece runs
    as it is enqueued). TTFT budget 0: a waiting prompt goes before decode steps (on a GPU
    the decode lane is busy most of the time; on CPU its steps land at once)."""
    executor = StreamExecutor(core, SpeculationPolicy(core), LaneStreams(core.device))
    assert executor.background_lanes == {"prefill"}
    return LaneDispatcher(core, executor.launch, outputs.append, 0.0,
                          background_lanes=executor.background_lanes)  # fmt: skip


async def _run(d: LaneDispatcher, core: EngineCore, max_iters: int = 500) -> None:
    """The engine loop's shape: a tick, then a turn of the event loop."""
    for _ in range(max_iters):
        await d.tick()
        await asyncio.sleep(0)
        if not core.has_unfinished() and not d.in_flight:
            return
    raise AssertionError("requests did not finish")


def _tokens(outputs: list) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for o in outputs:
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


async def test_decode_steps_launch_while_a_prompt_step_is_enqueued() -> None:
    core = _core(slice_layers=1)
    outputs: list = []
    d = _dispatcher(core, outputs)
    inner, pieces = core.launch_iter, []

    def launch_iter(plan, every):  # notes the launch log at each piece of a prompt step
        gen = inner(plan, every)
        while True:
            pieces.append((plan.seqs[0].seq.request_id, len(d.launch_log)))
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value
            yield

    core.launch_iter = launch_iter
    core.add_request("a", [5, 6, 7, 8], GREEDY)
    for _ in range(6):  # a is prefilled and decoding
        await d.tick()
        await asyncio.sleep(0)
    assert "decode" in d.launch_log
    core.add_request("b", list(range(3, 50)), GREEDY)
    await _run(d, core)
    b = [at for rid, at in pieces if rid == "b"]
    assert len(b) == 2  # two layers: two pieces
    assert "decode" in d.launch_log[b[0] : b[-1]]  # a decoded while b's prompt was enqueued
    # The same tokens as the engine launching every step whole.
    reference = await _reference([("a", [5, 6, 7, 8], GREEDY), ("b", list(range(3, 50)), GREEDY)])
    assert _tokens(outputs) == reference and len(reference["b"]) == 12
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def _whole_launcher(core: EngineCore):
    async def launch(lane: str, plan: StepPlan):
        return core.launch(plan)

    return launch


async def _reference(requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Each request's tokens from an engine without a drafter launching every step whole."""
    core = _core(slice_layers=0)
    outputs: list = []
    d = LaneDispatcher(core, _whole_launcher(core), outputs.append, 0.5)
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    await _run(d, core)
    return _tokens(outputs)


@pytest.mark.parametrize("failure", ["request", "step"])
async def test_a_prompt_step_failing_part_way_ends_its_requests_only(failure: str) -> None:
    core = _core(slice_layers=1)
    outputs: list = []
    d = _dispatcher(core, outputs)
    inner = core.launch_iter

    def launch_iter(plan, every):
        gen = inner(plan, every)
        next(gen)  # the first piece is enqueued, then the step fails
        yield
        if any(e.seq.request_id == "bad" for e in plan.seqs):
            if failure == "request":
                raise RequestFailure({"bad"}, ValueError("its own input"))
            raise RuntimeError("device lost")
        return drain(gen)

    core.launch_iter = launch_iter
    core.add_request("ok", [5, 6, 7, 8], GREEDY)
    for _ in range(6):
        await d.tick()
        await asyncio.sleep(0)
    core.add_request("bad", list(range(3, 40)), GREEDY)
    await _run(d, core)
    finish = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finish == {"ok": "length", "bad": "error"}
    assert len(_tokens(outputs)["ok"]) == 12
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


async def test_cancel_launches_stops_a_launch_part_way() -> None:
    core = _core(slice_layers=1)
    d = _dispatcher(core, [])
    core.add_request("a", list(range(3, 30)), GREEDY)
    await d.tick()  # the prompt step's launch starts as a task and pauses after a piece
    assert d.in_flight["prefill"].pending is None and len(d._launches) == 1
    d.cancel_launches()
    for _ in range(3):
        await asyncio.sleep(0)
    assert not d._launches and d.in_flight["prefill"].pending is None


async def test_a_first_token_goes_out_before_anything_more_is_launched() -> None:
    """The tick that hands out a first token returns before launching (the next launch may
    be a long host section: TTFT must not wait for it); later tokens do not stop a tick."""
    core = _core(slice_layers=0)
    outputs: list = []
    d = LaneDispatcher(core, _whole_launcher(core), outputs.append, 0.5)
    core.add_request("a", [5, 6, 7, 8], GREEDY)
    await d.tick()
    assert d.launch_log == ["prefill"] and not outputs
    assert await d.tick()  # the prompt step landed (CPU): its token goes out, nothing launches
    assert d.launch_log == ["prefill"] and len(outputs) == 1
    await d.tick()
    assert d.launch_log == ["prefill", "decode"]
    await d.tick()  # the decode step's token goes out and the next decode step launches
    assert d.launch_log == ["prefill", "decode", "decode"] and len(outputs) == 2


@pytest.mark.parametrize("stream", ["follow", "prefill"])
async def test_the_drafter_follows_a_prompt_step_in_pieces(
    stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``follow_prefill`` the drafter's KV of a prompt is computed behind its prompt step,
    after the launch has returned (the step lands meanwhile), in pieces of
    ``prefill_slice_layers`` (other steps launch in between), on the follow stream or the
    prompt step's own (``follow_prefill_stream``); nothing drafts for the request until it is
    enqueued, and its first speculative round needs no catch-up. Lossless, nothing leaked."""
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3,
                           initial_draft_len=3, follow_prefill=True,
                           follow_prefill_stream=stream)  # fmt: skip
    lanes: list[str] = []
    in_pieces = StreamExecutor._in_pieces

    def noted(self, lane, pieces):
        lanes.append(lane)
        return in_pieces(self, lane, pieces)

    monkeypatch.setattr(StreamExecutor, "_in_pieces", noted)
    sched = SchedulerConfig(max_prefill_chunk=64, max_num_batched_tokens=64)
    fed_metric = _FedTokens()
    core = EngineCore(tiny_config(spec=spec, scheduler=sched, prefill_slice_layers=1), fed_metric)
    outputs: list = []
    d = _dispatcher(core, outputs)  # its speculation policy attaches the controller
    pin_costs(core.costs, core.controller)
    drafter = core.spec.drafter
    inner, pieces, fed, drafted = drafter.follow_iter, [], {}, []

    def follow_iter(items, every, *args):  # notes the launch log at each piece of the drafter's
        assert every == 1
        gen = inner(items, every, *args)
        while True:
            pieces.append((items[0][0].request_id, len(d.launch_log)))
            try:
                next(gen)
            except StopIteration as stop:
                for seq, end in items:
                    fed.setdefault(seq.request_id, []).append(end)
                return stop.value
            yield

    def draft(entries, temps, draft=core.draft):  # who drafts, and whether b was being fed
        busy = {_rid(core, sid) for sid, v in drafter.views.items() if v.following}
        drafted.append(({e.seq.request_id for e in entries if e.draft_len}, busy))
        return draft(entries, temps)

    drafter.follow_iter, core.draft = follow_iter, draft
    core.add_request("a", [5, 6, 7, 8], LONG)
    for _ in range(6):  # a is prefilled and decoding (speculating: up to 4 tokens a step)
        await d.tick()
        await asyncio.sleep(0)
    assert any(lane != "prefill" for lane in d.launch_log)
    core.add_request("b", list(range(3, 103)), GREEDY)  # two prompt chunks
    await _run(d, core)
    assert fed == {"a": [4], "b": [64, 100]}  # every prompt token, chunk by chunk, in order
    assert (drafter.follower.num_followed_tokens, drafter.follower.num_follows_stopped) == (104, 0)
    assert fed_metric.tokens == [4, 64, 36]  # verifypd_spec_drafter_prompt_tokens_total
    # the prompt steps' pieces, and the drafter's forwards behind them on the chosen stream
    assert lanes.count(stream) == (3 if stream == "follow" else 6)
    assert set(lanes) == {"prefill", stream}
    b = [at for rid, at in pieces if rid == "b"]
    assert len(b) == 6  # a chunk: claimed at its launch, then the drafter's two layers
    assert d.launch_log[b[0] : b[-1]]  # a step launched while the drafter's was enqueued
    assert any("b" in who for who, _ in drafted)  # b speculated once fed ...
    assert core.controller.decisions["catch_up"] == 0  # ... with no catch-up round
    assert any("b" in busy for _, busy in drafted)  # a drafted while b was being fed ...
    assert not any(who & busy for who, busy in drafted)  # ... and b never then
    reference = await _reference([("a", [5, 6, 7, 8], LONG), ("b", list(range(3, 103)), GREEDY)])
    assert _tokens(outputs) == reference
    assert core.spec.num_verifies > 0
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks and drafter.kv.usage == 0


class _FedTokens(Observer):
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def drafter_prompt_tokens(self, num_tokens: int) -> None:
        self.tokens.append(num_tokens)


def _rid(core: EngineCore, seq_id: int) -> str | None:
    return next((s.request_id for s in core.running if s.seq_id == seq_id), None)


async def test_a_request_ending_while_the_drafter_follows_it_stops_the_follow() -> None:
    """A request aborted between the pieces of the drafter's forward behind its prompt step:
    the follow stops (its batch-mates' drafters catch up later), and the request's drafter
    blocks go back only once it has (on a GPU: once the pieces enqueued have run), so no
    piece writes to blocks handed out again; the rest goes on losslessly."""
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3,
                           initial_draft_len=3, follow_prefill=True)  # fmt: skip
    sched = SchedulerConfig(max_prefill_chunk=64, max_num_batched_tokens=64)
    core = EngineCore(tiny_config(spec=spec, scheduler=sched, prefill_slice_layers=1))
    outputs: list = []
    d = _dispatcher(core, outputs)
    drafter = core.spec.drafter
    inner, fed, usage = drafter.follow_iter, [], []

    def follow_iter(items, *args):
        gen = inner(items, *args)
        next(gen)  # the views are claimed
        next(gen)  # the first piece is enqueued
        yield
        if any(seq.request_id == "b" for seq, _ in items):
            before = drafter.kv.usage
            outputs.extend(core.abort_request("b"))
            usage.append((before, drafter.kv.usage))  # b's blocks held: a piece is enqueued
        fed.append((sorted(seq.request_id for seq, _ in items), (yield from gen)))
        usage.append(drafter.kv.usage)  # the follow stopped: b's blocks went back

    drafter.follow_iter = follow_iter
    core.add_request("b", list(range(3, 23)), GREEDY)
    core.add_request("c", list(range(30, 50)), GREEDY)
    await _run(d, core)
    assert fed == [(["b", "c"], 0)]  # one prompt step for both; its follow stopped
    (before, held), after = usage
    assert before == held > after > 0  # c keeps its blocks
    assert (drafter.follower.num_followed_tokens, drafter.follower.num_follows_stopped) == (0, 1)
    finish = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finish == {"b": "abort", "c": "length"}
    assert _tokens(outputs)["c"] == (await _reference([("c", list(range(30, 50)), GREEDY)]))["c"]
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks and drafter.kv.usage == 0


async def test_closing_the_executor_stops_the_drafter_following_a_prompt() -> None:
    """Forwards behind prompt steps run one after another; a queued one has claimed its
    request at its launch (the policy sees it busy before its turn). The engine stops while
    they are being enqueued: ``close`` cancels them and nothing stays ``following`` (the
    requests are drafted for again later, from where their drafter got)."""
    spec = tiny_draft_spec(controller=True, policy="goodput", follow_prefill=True)
    sched = SchedulerConfig(max_prefill_chunk=64, max_num_batched_tokens=64)
    core = EngineCore(tiny_config(spec=spec, scheduler=sched, prefill_slice_layers=1))
    executor = StreamExecutor(core, SpeculationPolicy(core), LaneStreams(core.device))
    seqs = []
    for rid, n in (("a", 30), ("b", 20)):
        (seq,) = core.add_request(rid, list(range(3, 3 + n)), GREEDY)
        seqs.append(seq)
        plan = StepPlan("prefill", core.scheduler.plan_prefill(64, 8))
        assert [e.seq for e in plan.seqs] == [seq]
        pending = await executor.launch("prefill", plan)
        assert executor.busy and core.drafter_busy(seq)  # claimed at its launch
        core.apply_step(plan, pending.result())  # landed (CPU): its first token is out
    await asyncio.sleep(0)
    a, b = (core.spec.drafter.views[s.seq_id] for s in seqs)
    assert (a.following, a.num_computed_tokens) == (0, 30)  # fed while b's step launched
    assert (b.following, b.num_computed_tokens) == (1, 0) and core.drafter_busy(seqs[1])
    executor.close()
    for _ in range(3):
        await asyncio.sleep(0)
    assert not executor.busy and not any(map(core.drafter_busy, seqs))
    assert (b.following, b.follow_end, b.num_computed_tokens) == (0, 0, 0)


class _Event:
    """A CUDA event's host side: ``query`` is True once the GPU has passed it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_request_is_busy_until_its_follow_has_run_on_the_gpu() -> None:
    """The follow stream runs below every lane: until the forward behind a request's prompt
    has run there, drafting for it would make the decode stream wait for it."""
    spec = tiny_draft_spec(controller=True, policy="goodput", follow_prefill=True)
    core = EngineCore(tiny_config(spec=spec))
    (seq,) = core.add_request("a", list(range(3, 23)), GREEDY)
    drafter = core.spec.drafter
    assert not core.drafter_busy(seq)  # no view yet
    view = drafter.views[seq.seq_id] = DraftView(seq)
    view.ready = event = _Event()
    assert core.drafter_busy(seq)
    event.done = True
    assert not core.drafter_busy(seq)
    assert view.ready is None  # passed: dropped, not asked about again
    view.following = 1
    assert core.drafter_busy(seq)
