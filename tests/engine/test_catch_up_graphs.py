"""The drafter's first draft step made uniform for a catch-up graph (``uniform_catch_up``):
which query length it picks, and that it never rewinds into a graph that does not exist."""

from types import SimpleNamespace

import pytest

from verifypd.config import SpecConfig
from verifypd.engine.draft_catch_up import uniform_catch_up


def _views(*lags, tokens=100):
    return [SimpleNamespace(num_tokens=tokens, num_computed_tokens=tokens - lag) for lag in lags]


def _graphs(*qs, max_batch=64):
    return {q: SimpleNamespace(max_batch=max_batch, with_logits=True) for q in qs}


@pytest.mark.parametrize(
    ("lags", "qs", "want"),
    [
        ((1, 1, 1), (1, 2, 4, 8), 1),  # all caught up: the decode graph as is
        ((1, 2, 1), (1, 2, 4, 8), 2),  # all drafts accepted somewhere: q = 2
        ((1, 3, 2), (1, 2, 4, 8), 4),  # three plain steps: the q = 4 graph
        ((5, 1, 8), (1, 2, 4, 8), 8),
        ((5, 1, 9), (1, 2, 4, 8), None),  # beyond every graph: eager, nothing rewound
        ((1, 3, 2), (1, 2), None),  # no catch-up graphs (SpecConfig.catch_up_graphs=())
    ],
)
def test_every_view_feeds_the_smallest_covering_graph(lags, qs, want):
    views = _views(*lags)
    uniform_catch_up(views, _graphs(*qs))
    fed = [v.num_tokens - v.num_computed_tokens for v in views]
    assert fed == ([want] * len(lags) if want else list(lags))


def test_no_rewind_past_a_graphs_batch_or_a_short_context():
    views = _views(3, 1)
    uniform_catch_up(views, _graphs(1, 2, 4, max_batch=1))  # two rows, graphs hold one
    assert [v.num_tokens - v.num_computed_tokens for v in views] == [3, 1]
    views = _views(3, 1, tokens=3)  # a 3-token context cannot feed 4
    uniform_catch_up(views, _graphs(1, 2, 4))
    assert [v.num_tokens - v.num_computed_tokens for v in views] == [3, 1]


def test_the_first_draft_step_never_replays_a_graph_without_logits():
    views = _views(12, 3)
    graphs = _graphs(1, 2, 4, 8, 16)
    graphs[16].with_logits = False  # a chunk graph: it writes KV and samples nothing
    uniform_catch_up(views, graphs)
    assert [v.num_tokens - v.num_computed_tokens for v in views] == [12, 3]  # eager
    graphs[16].with_logits = True
    uniform_catch_up(views, graphs)
    assert [v.num_tokens - v.num_computed_tokens for v in views] == [16, 16]


@pytest.mark.parametrize("bad", [(2,), (8, 4), (4, 4), (65,), [4, 8]])
def test_catch_up_graphs_are_validated(bad):
    with pytest.raises(ValueError, match="catch_up_graphs"):
        SpecConfig(catch_up_graphs=bad)


def _proposer():
    import torch

    from verifypd.engine.loader import load_model
    from verifypd.engine.speculative import DraftModelProposer
    from verifypd.kernels import get_ops

    loaded = load_model("dummy:tiny", torch.device("cpu"), torch.float32, get_ops())
    return DraftModelProposer(loaded, 64, 4, torch.device("cpu"), torch.float32)


def _fake_table(*qs):
    """A graph table as a GPU would have it (this CPU captures none: each step runs eager)."""
    return {q: SimpleNamespace(max_batch=8, can_run=lambda *a: False, with_logits=True) for q in qs}


def _fake_graphs(prop, *qs):
    prop.runner.graphs = _fake_table(*qs)


def _record_feeds(prop) -> list[list[int]]:
    """Every forward the drafter prepares from now on: the tokens it feeds each row."""
    fed: list[list[int]] = []
    real_prepare = prop.runner.prepare
    prop.runner.prepare = lambda plan: (
        fed.append([e.num_new_tokens for e in plan.seqs]) or real_prepare(plan)
    )
    return fed


def _greedy_seqs(prompts):
    from verifypd.types import SamplingParams, Sequence

    return [Sequence(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0))
            for i, p in enumerate(prompts)]  # fmt: skip


def _propose(prop, prompts, chunk, chunks):
    from verifypd.types import ScheduledSeq

    prop.catch_up_chunk, prop.catch_up_chunks = chunk, chunks
    fed = _record_feeds(prop)
    seqs = _greedy_seqs(prompts)
    entries = [ScheduledSeq(s, 1) for s in seqs]
    prop.propose(entries, [3] * len(seqs), [0.0] * len(seqs))
    return fed, [e.draft_ids() for e in entries]


def test_a_fresh_drafter_catches_up_in_chunk_replays_and_drafts_the_same():
    prompts = [
        [(7 * i + 3) % 97 + 1 for i in range(150)],
        [(5 * i + 1) % 89 + 1 for i in range(90)],
    ]
    prop = _proposer()
    _fake_graphs(prop, 1, 2, 4, 8, 64)
    fed, drafts = _propose(prop, prompts, chunk=(64,), chunks=8)
    # 150 and 90 behind: two replays of both (the second re-feeds stored tokens of the 90),
    # a third of the first alone; then each feeds its last token and drafts.
    assert fed[:4] == [[64, 64], [64, 64], [64], [1, 1]]
    assert prop.last_catch_up == 150
    eager = _proposer()
    _fake_graphs(eager, 1, 2, 4, 8, 64)
    fed_eager, drafts_eager = _propose(eager, prompts, chunk=(), chunks=0)
    assert fed_eager[0] == [150, 90]  # one eager forward over both contexts
    assert drafts == drafts_eager


def test_a_context_past_the_chunk_budget_is_left_to_the_eager_step():
    prop = _proposer()
    _fake_graphs(prop, 1, 2, 4, 8, 64)
    fed, _ = _propose(prop, [[1 + i % 50 for i in range(200)]], chunk=(64,), chunks=2)
    assert fed[0] == [200]


def test_each_far_drafter_replays_the_largest_chunk_its_context_exceeds():
    prompts = [
        [(7 * i + 3) % 97 + 1 for i in range(150)],  # q = 64: 0-64, 64-128, 85-149
        [(5 * i + 1) % 89 + 1 for i in range(40)],  # q = 16 (no longer than 64): 0-16, 16-32
    ]
    prop = _proposer()
    _fake_graphs(prop, 1, 2, 4, 8, 16, 64)
    fed, drafts = _propose(prop, prompts, chunk=(16, 64), chunks=8)
    # then the first draft step replays the q = 8 graph for both (the 40 is 8 behind)
    assert fed[:6] == [[16], [16], [64], [64], [64], [8, 8]]
    eager = _proposer()
    _fake_graphs(eager, 1, 2, 4, 8, 16, 64)
    fed_eager, drafts_eager = _propose(eager, prompts, chunk=(), chunks=0)
    assert fed_eager[0] == [150, 40]
    assert drafts == drafts_eager


def test_a_context_no_chunk_fits_leaves_every_far_drafter_to_the_eager_step():
    prop = _proposer()
    _fake_graphs(prop, 1, 2, 4, 8, 16, 64)
    fed, _ = _propose(prop, [[1 + i % 50 for i in range(150)], [3] * 12], chunk=(16, 64), chunks=8)
    assert fed[0] == [150, 12]  # 12 tokens: no longer than the smallest chunk


def test_more_far_drafters_than_a_chunk_graph_holds_replay_in_turns():
    prop = _proposer()
    _fake_graphs(prop, 1, 2, 4, 8, 16)
    for g in prop.runner.graphs.values():
        g.max_batch = 2
    prompts = [[1 + (i * k) % 50 for i in range(20)] for k in (1, 2, 3)]
    fed, _ = _propose(prop, prompts, chunk=(16,), chunks=8)
    # two rows, then the third alone; each is 4 behind: the first draft step replays q = 4
    assert fed[:3] == [[16, 16], [16], [4, 4, 4]]


@pytest.mark.parametrize("good", [0, 64, (16, 64, 256), (16, 64, 256, 1024)])
def test_chunk_sizes_are_accepted(good):
    sizes = SpecConfig(catch_up_chunk=good).chunk_sizes
    assert sizes == ((good,) if isinstance(good, int) and good else good or ())


@pytest.mark.parametrize("bad", [(64, 16), (16, 16), (8,), (2048,), [16, 64], 4, "64"])
def test_chunk_sizes_are_validated(bad):
    with pytest.raises(ValueError, match="catch_up_chunk"):
        SpecConfig(catch_up_chunk=bad)


def _follow(prop, prompts, sizes):
    """The drafter following whole prompts (``follow_iter``) with fake follow-stream chunk
    graphs of ``sizes`` (each replay still runs eager here, fed the same q tokens a row);
    returns the tokens each forward fed per row, the count it reported, and the sequences."""
    from verifypd.engine.model import drain

    prop.follower.follow_graphs = _fake_table(*sizes)
    real_prepare = prop.runner.prepare
    fed = _record_feeds(prop)
    seqs = _greedy_seqs(prompts)
    count = drain(prop.follow_iter([(s, s.num_tokens) for s in seqs], every=0))
    prop.runner.prepare = real_prepare
    return fed, count, seqs


def _drafts_after(prop, seqs):
    from verifypd.types import ScheduledSeq

    entries = [ScheduledSeq(s, 1) for s in seqs]
    prop.propose(entries, [3] * len(seqs), [0.0] * len(seqs))
    return [e.draft_ids() for e in entries]


def test_the_follow_feeds_prompts_in_chunk_replays_and_drafts_the_same():
    prompts = [
        [(7 * i + 3) % 97 + 1 for i in range(150)],
        [(5 * i + 1) % 89 + 1 for i in range(40)],
        [(3 * i + 2) % 61 + 1 for i in range(10)],  # shorter than every q: eager
    ]
    prop = _proposer()
    fed, count, seqs = _follow(prop, prompts, (16, 64))
    # 150: 64, 64, then 22 behind -> 16 (at 128) and 6 behind -> 16 re-feeding 10 stored;
    # 40: 16, 16, then 8 behind -> 16 re-feeding 8; the 10-token prompt in one eager forward
    assert fed == [[16], [64], [16], [64], [16, 16], [16], [10]]
    follower = prop.follower
    assert count == 200 and follower.num_followed_tokens == 200 and follower.num_follow_replays == 6
    assert [prop.views[s.seq_id].num_computed_tokens for s in seqs] == [150, 40, 10]
    eager = _proposer()
    fed_eager, _, eager_seqs = _follow(eager, prompts, ())
    assert fed_eager == [[150, 40, 10]]
    fresh = _proposer()  # no follow: the proposal catches up itself
    drafts = _drafts_after(prop, seqs)
    assert drafts == _drafts_after(eager, eager_seqs) == _drafts_after(fresh, _greedy_seqs(prompts))


def test_a_request_ending_part_way_stops_the_replays_and_keeps_the_others_progress():
    prompts = [[1 + i % 50 for i in range(150)], [2 + i % 40 for i in range(90)]]  # 60 blocks
    prop = _proposer()
    from verifypd.types import SamplingParams, Sequence

    prop.follower.follow_graphs = _fake_table(64)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)]
    pieces = prop.follow_iter([(s, s.num_tokens) for s in seqs])
    next(pieces)  # claimed
    next(pieces)  # one replay of both enqueued
    views = [prop.views[s.seq_id] for s in seqs]
    assert [v.num_computed_tokens for v in views] == [64, 64]
    prop.free(seqs[0].seq_id)  # the first request ends
    with pytest.raises(StopIteration) as stop:
        next(pieces)
    assert stop.value.value == 0 and prop.follower.num_follows_stopped == 1
    assert views[1].num_computed_tokens == 64 and not views[1].following
    assert prop.views.get(seqs[0].seq_id) is None


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_chunk_short_attention_is_a_bool(bad):
    with pytest.raises(ValueError, match="chunk_short_attention must be a bool"):
        SpecConfig(chunk_short_attention=bad)
