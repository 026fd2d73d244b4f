"""The drafter's context window (``SpecConfig.draft_window``): a view of a long prompt holds its
first ``draft_window_sink`` and last ``draft_window`` tokens, so the drafter's pass over the
prompt costs at most sink + window tokens, and output stays token-identical to plain greedy
decoding whatever the window (dummy:tiny on CPU, a drafter perturbed so that it only sometimes
agrees with the target)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import generate_all, pin_costs, spy_drafter, tiny_config, tiny_draft_spec

from verifypd.config import SpecConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.draft_view import DraftView, window_skip
from verifypd.engine.loader import load_model
from verifypd.engine.speculative import DraftModelProposer
from verifypd.kernels import get_ops
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan

PROMPTS = [list(range(10, 60)), [7] * 40, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
WINDOW, SINK = 8, 2


def _seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, [1 + i % 97 for i in range(n)], SamplingParams(max_tokens=8))


def test_a_view_keeps_the_sink_and_the_window_and_maps_counts_onto_them():
    seq = _seq(30)
    view = DraftView(seq, WINDOW, SINK)
    assert view.skip == window_skip(seq, WINDOW, SINK) == 30 - SINK - WINDOW
    ids = view.ids_of(seq.token_ids)
    assert ids == seq.token_ids[:SINK] + seq.token_ids[-WINDOW:]
    assert [view.local(n) for n in (0, 1, 2, 3, 21, 22, 23, 30, 35)] == [
        0, 1, 2, 2, 2, 2, 3, 10, 15,
    ]  # fmt: skip
    assert [view.seq_end(k) for k in (1, 2, 3, 10)] == [1, 2, 23, 30]
    assert all(view.local(view.seq_end(k)) == k for k in range(0, 16))
    short = _seq(SINK + WINDOW)  # no longer than sink + window: the whole prompt
    assert DraftView(short, WINDOW, SINK).skip == 0
    assert DraftView(seq).skip == 0 and DraftView(seq).ids_of(seq.token_ids) == seq.token_ids


def _proposer(window: int | None) -> DraftModelProposer:
    loaded = load_model("dummy:tiny", torch.device("cpu"), torch.float32, get_ops())
    prop = DraftModelProposer(loaded, 64, 4, torch.device("cpu"), torch.float32)
    prop.window, prop.window_sink = window, SINK
    return prop


def test_windowed_drafts_are_a_drafter_s_drafts_on_the_sink_and_window_alone():
    """Positions are the view's own: a windowed view of a 40-token prompt drafts exactly what
    a drafter without a window drafts for a prompt of those 10 tokens (and feeds only them),
    and not what it drafts with the whole context."""
    seq = _seq(40)
    windowed = _proposer(WINDOW)
    assert windowed.behind(seq) == SINK + WINDOW  # nothing fed yet: the window's tokens
    entry = ScheduledSeq(seq, 1)
    windowed.propose([entry], [4], [0.0])
    assert windowed.last_catch_up == SINK + WINDOW

    plain = _proposer(None)
    short = Sequence("s", seq.token_ids[:SINK] + seq.token_ids[-WINDOW:], seq.params)
    same = ScheduledSeq(short, 1)
    plain.propose([same], [4], [0.0])
    assert entry.draft_ids() == same.draft_ids()
    whole = ScheduledSeq(_seq(40, "w"), 1)
    plain.propose([whole], [4], [0.0])
    assert whole.draft_ids() != entry.draft_ids()  # the middle mattered to this drafter

    view = windowed.views[seq.seq_id]
    seq.token_ids += entry.draft_ids()[:2] + [5]  # two drafts accepted and a correction
    windowed.verified(seq.seq_id, 2)
    assert windowed.behind(seq) == 1  # the correction only: d1, d2 kept their KV
    nxt = ScheduledSeq(seq, 1)
    windowed.propose([nxt], [2], [0.0])
    assert view.token_ids[: view.local(seq.num_tokens)] == view.ids_of(seq.token_ids)
    windowed.free(seq.seq_id)
    assert windowed.kv.usage == 0


def _engine(window: int | None, chain: bool = False, controller: bool = False, **kw):
    spec = tiny_draft_spec(
        controller=controller, policy="goodput", chain_drafts=chain, max_draft_len=3,
        initial_draft_len=3, draft_window=window, draft_window_sink=SINK, **kw,
    )  # fmt: skip
    engine = AsyncEngine(tiny_config(spec=spec))
    if controller:
        pin_costs(engine.core.costs, engine.core.controller)
    target, drafter = engine.core.loaded.model, engine.core.spec.drafter.runner.model
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for pd, pt in zip(drafter.parameters(), target.parameters(), strict=True):
            pd.copy_(pt + 0.1 * pt.std() * torch.randn(pt.shape, generator=gen))
    return engine


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return asyncio.run(generate_all(AsyncEngine(tiny_config()), PROMPTS, GREEDY))


def _widest_views(engine: AsyncEngine) -> list[int]:
    """The longest view each proposal prepared (recorded as the engine runs)."""
    drafter, widths = engine.core.spec.drafter, []
    prepare = drafter._prepare_view

    def spy(seq, n):
        view = prepare(seq, n)
        if view is not None:
            widths.append((seq.num_prompt_tokens, view.skip, view.num_tokens - seq.num_tokens))
        return view

    drafter._prepare_view = spy
    return widths


def _chained_skips(engine: AsyncEngine) -> list[int]:
    """The ``skip`` of every view whose next round was drafted behind its verify."""
    drafter, skips = engine.core.spec.drafter, []
    chain = drafter.chainer.chain

    def spy(*args):
        rows = chain(*args)
        if drafter.chained is not None:
            skips.extend(drafter.views[sid].skip for sid in drafter.chained.rows)
        return rows

    drafter.chainer.chain = spy
    return skips


@pytest.mark.parametrize(
    "chain, controller, extra",
    [
        (False, False, {}),
        (True, False, {}),
        (False, True, {}),
        (False, True, {"follow_decode_max_rows": 8}),
    ],
    ids=["fixed", "chained", "policy", "policy-follow-decode"],
)
async def test_a_windowed_drafter_is_lossless_and_feeds_only_the_window(
    reference, chain, controller, extra
):
    engine = _engine(WINDOW, chain, controller, **extra)
    widths = _widest_views(engine)
    fed, catch_ups = spy_drafter(engine)
    chained_skips = _chained_skips(engine)
    assert await generate_all(engine, PROMPTS, GREEDY) == reference
    if chain:  # rounds of windowed views were drafted behind their verify, and adopted
        assert any(chained_skips) and engine.core.spec.drafter.num_adopted > 0
    assert engine.core.spec.num_drafted > 0
    long = [(p, skip, d) for p, skip, d in widths if p > SINK + WINDOW]
    assert long and all(skip == p - SINK - WINDOW and d == -skip for p, skip, d in long)
    assert all(skip == 0 for p, skip, _ in widths if p <= SINK + WINDOW)
    # A view's feed: its window and the tokens decoded plainly before it drafts (34 at most),
    # never a whole long prompt (40 or 50 tokens).
    assert max(catch_ups + fed) <= SINK + WINDOW + GREEDY.max_tokens < 40


async def test_the_drafter_follows_only_a_prompt_s_window():
    """Behind prompt steps (``follow_prefill``) the drafter feeds a long prompt's sink and
    window, nothing of its middle."""
    engine = _engine(WINDOW, controller=True, follow_prefill=True)
    fed, _ = spy_drafter(engine)
    prompts = [list(range(10, 60)), [9, 8, 7]]
    want = await generate_all(AsyncEngine(tiny_config()), prompts, GREEDY)
    assert await generate_all(engine, prompts, GREEDY) == want
    assert fed and sum(fed) <= (SINK + WINDOW) + 3 + 2 * 24  # windows, not the 50 tokens


def test_a_decode_follow_ends_inside_the_window():
    """Behind a plain step (``follow_decode_max_rows``) the follow item's end is a count of the
    sequence's tokens: all but its last, fed as the window's tokens."""
    spec = tiny_draft_spec(follow_decode_max_rows=4, draft_window=WINDOW, draft_window_sink=SINK)
    core = EngineCore(tiny_config(spec=spec))
    core.add_request("long", [1 + i % 97 for i in range(60)], GREEDY)
    while core.scheduler.waiting or not core.decodable():
        plan = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, 8))
        core.scheduler.begin_step(plan)
        core.apply_step(plan, core.launch(plan).result())
    step = StepPlan("decode", core.scheduler.plan_decode())
    core.scheduler.begin_step(step)
    items = core.follow_decode_items(step, lambda seq_id: True)
    seq = step.seqs[0].seq
    assert [end for _, end in items] == [seq.num_tokens - 1]
    for _ in core.follow_iter(items, on_decode=True):
        pass
    view = core.spec.drafter.views[seq.seq_id]
    assert view.num_computed_tokens == SINK + WINDOW  # of 61 tokens the view's 11, but the last
    assert core.drafter_behind(seq) == 1


@pytest.mark.parametrize("window, sink", [(0, 4), (-1, 4), (2.5, 4), ("8", 4), (8, -1), (8, 1.0)])
def test_the_window_is_validated(window, sink):
    with pytest.raises(ValueError, match="draft_window"):
        SpecConfig(draft_window=window, draft_window_sink=sink)
