"""``SpecConfig.follow_decode_max_rows``: the drafter catches up behind plain decode steps on
the contexts of requests the goodput policy expects to draft for, a chunk a step, so their
rounds start steady (no catch-up round whose context feed the whole step waits for); only at
light load, never for a row that drafts in the step, and lossless (dummy:tiny on CPU, the
policy's costs pinned as in test_goodput_lanes)."""

import asyncio

import pytest
import torch
from helpers import generate_all, pin_costs, spy_drafter, tiny_config, tiny_draft_spec

from verifypd.config import SpecConfig
from verifypd.controller import AcceptanceEstimate
from verifypd.engine.core import EngineCore
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams, SpecDecision, StepPlan

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7] * 40, list(range(10, 60)), [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(rows: int, useless_drafter: bool = False, stream: str = "decode") -> AsyncEngine:
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3,
                           initial_draft_len=3, follow_decode_max_rows=rows,
                           follow_decode_stream=stream)  # fmt: skip
    engine = AsyncEngine(tiny_config(spec=spec))
    pin_costs(engine.core.costs, engine.core.controller)
    if useless_drafter:
        with torch.no_grad():
            for p in engine.core.spec.drafter.runner.model.parameters():
                p.copy_(torch.randn_like(p))
    return engine


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return asyncio.run(generate_all(AsyncEngine(tiny_config()), PROMPTS, GREEDY))


@pytest.mark.parametrize("stream", ["decode", "beside"])
async def test_the_drafter_catches_up_behind_plain_steps_and_rounds_start_steady(reference, stream):
    """A row's second token is plain (``second_token_plain``): behind that step the drafter
    is fed its prompt, so no proposal feeds a whole context; without the follow they do.
    ``beside`` (the feed stream's, on a GPU) feeds the same on CPU."""
    engine = _engine(rows=8, stream=stream)
    fed, catch_ups = spy_drafter(engine)
    assert await generate_all(engine, PROMPTS, GREEDY) == reference
    assert sum(fed) >= sum(len(p) for p in PROMPTS)  # every prompt, behind a plain step
    assert catch_ups and max(catch_ups) <= 2
    assert engine.core.spec.num_drafted > 0

    engine = _engine(rows=0)
    fed, catch_ups = spy_drafter(engine)
    assert await generate_all(engine, PROMPTS, GREEDY) == reference
    assert not fed and max(catch_ups) >= min(len(p) for p in PROMPTS)


async def test_a_parked_policy_has_the_drafter_follow_nobody(reference):
    engine = _engine(rows=8, useless_drafter=True)
    engine.core.controller.population = AcceptanceEstimate(0.02, 0.0)  # many rejected verifies
    fed, _ = spy_drafter(engine)
    assert await generate_all(engine, PROMPTS, GREEDY) == reference  # lossless anyway
    assert not fed


PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _core(most: int) -> EngineCore:
    return EngineCore(tiny_config(spec=tiny_draft_spec(follow_decode_max_rows=most)))


def _decode_plan(core: EngineCore, n: int, drafting: int = 0) -> StepPlan:
    """``n`` requests prefilled and landed, and their first decode step begun (the first
    ``drafting`` of them with L = 2)."""
    for i in range(n):
        core.add_request(f"d{i}", [1 + i, 2, 3, 4, 5], PARAMS)
    plan = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, 8))
    core.scheduler.begin_step(plan)
    core.apply_step(plan, core.launch(plan).result())
    ids = [s.seq_id for s in core.decodable()][:drafting]
    step = StepPlan("decode", core.scheduler.plan_decode(SpecDecision(dict.fromkeys(ids, 2))))
    core.scheduler.begin_step(step)
    return step


@pytest.mark.parametrize(
    "most,decoding,drafting,waiting,followed",
    [
        (2, 2, 0, 0, ["d0", "d1"]),
        (2, 3, 0, 0, []),  # three decode: beyond the light load
        (4, 3, 1, 0, ["d1", "d2"]),  # d0 drafts in the step: the proposer feeds it
        (4, 2, 0, 1, []),  # a prompt waits
        (0, 1, 0, 0, []),  # off
    ],
)
def test_the_drafter_follows_a_decode_steps_plain_rows_only_at_light_load(
    most, decoding, drafting, waiting, followed
):
    core = _core(most)
    step = _decode_plan(core, decoding, drafting)
    for i in range(waiting):
        core.add_request(f"w{i}", [5, 6, 7], PARAMS)
    items = core.follow_decode_items(step, lambda seq_id: True)
    assert [seq.request_id for seq, _ in items] == followed
    assert all(end == seq.num_tokens - 1 for seq, end in items)  # all but its last token
    assert core.follow_decode_items(step, lambda seq_id: False) == []


@pytest.mark.parametrize(
    "feed, want",
    [(None, [[256], [512], [602], []]), (64, [[64], [128], [192], [256]])],
)
def test_a_long_context_is_fed_one_chunk_a_step(feed, want):
    """At most the largest ``catch_up_chunk`` (256) more tokens a step, or
    ``follow_decode_tokens``: a 600-token prompt's drafter catches up over three plain steps
    (then is not followed again), or 64 tokens a step."""
    spec = tiny_draft_spec(follow_decode_max_rows=4, follow_decode_tokens=feed)
    core = EngineCore(tiny_config(spec=spec))
    prompt = [1 + i % 500 for i in range(600)]
    core.add_request("long", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    while core.scheduler.waiting or not core.decodable():
        plan = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, 8))
        core.scheduler.begin_step(plan)
        core.apply_step(plan, core.launch(plan).result())
    ends = []
    for _ in range(4):
        step = StepPlan("decode", core.scheduler.plan_decode())
        core.scheduler.begin_step(step)
        items = core.follow_decode_items(step, lambda seq_id: True)
        ends.append([end for _, end in items])
        for _ in core.follow_iter(items, on_decode=True):
            pass
        core.apply_step(step, core.launch(step).result())
    assert ends == want  # 602: all but the last of 600 + 3 tokens
    fed = core.spec.drafter.views[core.decodable()[0].seq_id].num_computed_tokens
    assert fed == max(e for step in want for e in step)


def test_a_view_being_fed_behind_a_step_is_not_drafted_for():
    """Claimed by a follow (its forward not yet enqueued), a view is left to it: a proposal
    in between drafts nothing for its row, which then decodes plainly."""
    core = _core(4)
    step = _decode_plan(core, 2)
    items = core.follow_decode_items(step, lambda seq_id: True)
    core.apply_step(step, core.launch(step).result())
    pieces = core.follow_iter(items[:1])
    next(pieces)  # claimed
    entries = core.scheduler.plan_decode(SpecDecision({s.seq_id: 2 for s in core.decodable()}))
    core.spec.propose(entries)
    drafts = {e.seq.request_id: len(e.draft_token_ids) for e in entries}
    assert drafts == {"d0": 0, "d1": 2}
    for _ in pieces:
        pass
    view = core.spec.drafter.views[items[0][0].seq_id]
    assert not view.following and view.num_computed_tokens == items[0][1]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4", None])
def test_follow_decode_max_rows_is_validated(bad):
    with pytest.raises(ValueError, match="follow_decode_max_rows"):
        SpecConfig(follow_decode_max_rows=bad)


@pytest.mark.parametrize("bad", [0, 32, 100, "64"])
def test_follow_decode_tokens_is_one_of_the_chunk_sizes(bad):
    assert SpecConfig(follow_decode_tokens=64).follow_decode_tokens == 64
    with pytest.raises(ValueError, match="follow_decode_tokens"):
        SpecConfig(follow_decode_tokens=bad)


def test_follow_decode_stream_is_validated_and_feeds_beside_only_with_rows():
    assert not SpecConfig(follow_decode_stream="beside").feeds_beside_decode  # rows 0: no feed
    assert SpecConfig(follow_decode_stream="beside", follow_decode_max_rows=4).feeds_beside_decode
    assert not SpecConfig(follow_decode_max_rows=4).feeds_beside_decode
    assert SpecConfig(follow_decode_stream="below", follow_decode_max_rows=4).feeds_beside_decode
    with pytest.raises(ValueError, match="follow_decode_stream"):
        SpecConfig(follow_decode_stream="follow")
