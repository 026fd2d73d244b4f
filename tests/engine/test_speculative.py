"""Draft-model proposer pieces that need no GPU: vocabulary guard and view rollback."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import tiny_config, tiny_draft_spec

from verifypd.engine.loader import load_model
from verifypd.engine.sampler import SamplingTensors, sample
from verifypd.engine.speculative import DraftModelProposer
from verifypd.kernels import get_ops
from verifypd.types import SamplingParams, ScheduledSeq, Sequence


def _proposer(num_blocks: int = 32) -> DraftModelProposer:
    loaded = load_model("dummy:tiny", torch.device("cpu"), torch.float32, get_ops())
    return DraftModelProposer(loaded, num_blocks, 4, torch.device("cpu"), torch.float32)


def test_target_ids_outside_the_drafter_vocab_map_to_zero():
    prop = _proposer()
    v = prop.vocab_size
    assert prop._drafter_ids([1, v - 1, v, v + 127]) == [1, v - 1, 0, 0]
    seq = Sequence("r", [3, 4, v + 5, 6], SamplingParams(max_tokens=8, temperature=0))
    entry = ScheduledSeq(seq, 1)
    prop.propose([entry], [3], [0.0])  # would index past the embedding without the guard
    assert len(entry.draft_token_ids) == 3
    assert all(0 <= t < v for t in entry.draft_ids())


def test_view_rolls_back_to_the_accepted_prefix_and_frees():
    prop = _proposer()
    seq = Sequence("r", list(range(1, 11)), SamplingParams(max_tokens=8, temperature=0))
    entry = ScheduledSeq(seq, 1)
    prop.propose([entry], [4], [0.0])
    view = prop.views[seq.seq_id]
    assert view.num_computed_tokens == 10 + 3  # last token and d1..d3 have KV, d4 does not
    seq.token_ids += entry.draft_ids()[:1] + [7]  # one accepted draft and a correction
    entry2 = ScheduledSeq(seq, 1)
    prop.propose([entry2], [2], [0.0])
    assert view.token_ids[:12] == seq.token_ids
    prop.free(seq.seq_id)
    assert prop.kv.usage == 0
    prop.kv.check_integrity([])


def test_first_draft_step_feeds_one_token_unless_a_view_accepted_every_draft():
    """The catch-up step is uniform (a CUDA graph of q = 1 or q = 2), and q = 2 only when some
    view must add both its last draft and the bonus token; a view further behind (plain steps)
    makes every view feed the smallest catch-up graph's q that covers it."""
    prop = _proposer()
    # The graphs' shapes as on a GPU (this CPU captures none: each step still runs eager).
    prop.runner.graphs = {
        q: SimpleNamespace(max_batch=64, can_run=lambda *a: False, with_logits=True)
        for q in (1, 2, 4, 8)
    }
    seqs = [Sequence(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=32, temperature=0))
            for i in range(2)]  # fmt: skip
    entries = [ScheduledSeq(s, 1) for s in seqs]
    prop.propose(entries, [3, 3], [0.0, 0.0])
    fed: list[list[int]] = []
    real_prepare = prop.runner.prepare
    prop.runner.prepare = lambda plan: (
        fed.append([e.num_new_tokens for e in plan.seqs]) or (real_prepare(plan))
    )

    def verify(accepted, *extra):  # what a landed verify does to the sequence and its view
        for s, e, a, bonus in zip(seqs, entries, accepted, extra, strict=True):
            s.token_ids += e.draft_ids()[:a] + bonus
            prop.verified(s.seq_id, a)

    verify([1, 1], [5], [6])  # one draft accepted each
    entries = [ScheduledSeq(s, 1) for s in seqs]
    prop.propose(entries, [3, 3], [0.0, 0.0])
    assert fed[0] == [1, 1]  # both caught up but the bonus token
    verify([3, 2], [5], [6])  # every draft accepted in the first
    entries = [ScheduledSeq(s, 1) for s in seqs]
    fed.clear()
    prop.propose(entries, [3, 3], [0.0, 0.0])
    assert fed[0] == [2, 2]  # the second view re-feeds one token to match the first
    for s in seqs:
        assert prop.views[s.seq_id].token_ids[: s.num_tokens] == s.token_ids
    verify([1, 1], [5, 7, 9], [6])  # then the first decodes plainly for two steps
    fed.clear()
    prop.propose([ScheduledSeq(s, 1) for s in seqs], [3, 3], [0.0, 0.0])
    # Its second draft's KV (at the position of 5) is stale: it re-feeds 5, 7, 9; three tokens
    # behind, both views feed the q = 4 graph's four.
    assert fed[0] == [4, 4]
    for s in seqs:
        assert prop.views[s.seq_id].token_ids[: s.num_tokens] == s.token_ids


def test_drafts_whose_verify_never_landed_are_not_kept():
    """Without a landed verify the drafter cannot know which drafts were right: at its next
    proposal it keeps the KV up to its first draft only."""
    prop = _proposer()
    seq = Sequence("r", list(range(1, 9)), SamplingParams(max_tokens=32, temperature=0))
    entry = ScheduledSeq(seq, 1)
    prop.propose([entry], [3], [0.0])
    seq.token_ids += entry.draft_ids()[:2] + [7]  # as if accepted, but never verified
    prop.propose([ScheduledSeq(seq, 1)], [3], [0.0])
    assert prop.last_catch_up == 3  # the two drafts and the bonus token, fed again


def test_greedy_accept_equals_rejection_sampling_on_one_hot_targets():
    from verifypd.engine.rejection import greedy_accept, rejection_sample

    gen = torch.Generator().manual_seed(0)
    b, width, vocab = 64, 4, 7
    target_ids = torch.randint(0, vocab, (b, width + 1), generator=gen)
    # drafts that often agree with the target, so every accepted length appears
    drafts = torch.where(
        torch.rand(b, width, generator=gen) < 0.7,
        target_ids[:, :width],
        torch.randint(0, vocab, (b, width), generator=gen),
    )
    num_drafts = torch.randint(0, width + 1, (b,), generator=gen)
    one_hot = torch.nn.functional.one_hot(target_ids, vocab).float()
    seeds, positions = torch.arange(b), torch.full((b,), 10)
    want = rejection_sample(one_hot, None, drafts, num_drafts, seeds, positions)
    got = greedy_accept(target_ids, drafts, num_drafts)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert set(got[1].tolist()) == set(range(width + 1))


def test_the_controller_learns_the_drafting_cost_from_proposals():
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.sync_driver import SyncDriver

    # A fixed L (the feedback controller would react to this CPU's timings); the fixed
    # controller feeds the same cost model.
    spec = tiny_draft_spec(initial_draft_len=3)
    core = EngineCore(tiny_config(spec=spec))
    driver = SyncDriver(core)
    model = core.controller.cost_model
    core.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=12, temperature=0))
    driver.step()  # prefill
    driver.step()  # the first proposal: the drafter catches up on the prompt, not counted
    assert core.spec.drafter.last_catch_up == 20  # the prompt and the first token
    assert model.num_observations["draft"] == 0
    while core.has_unfinished():
        driver.step()
    assert model.num_observations["draft"] > 0 and model.draft_cost() > 0
    assert core.spec.drafter.last_catch_up <= 2


def test_sampled_drafts_draw_at_each_step_own_position(monkeypatch):
    """A sampled proposal copies its sampling parameters to the device once; draft step j of a
    row must still draw with the row's seed at the position it drafts (its tokens so far), over
    the rows still drafting: the draws of tensors built on the host for that step."""
    from verifypd.engine import speculative

    prop = _proposer()
    seqs = [
        Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=32, temperature=0.8, seed=5)),
        Sequence("b", list(range(2, 7)), SamplingParams(max_tokens=32, temperature=1.2, seed=6)),
    ]
    calls: list[tuple[list[int], list[int]]] = []
    real = speculative.sample_with_probs

    def spy(logits, t):
        calls.append((t.positions.tolist(), t.seeds.tolist()))
        tokens, probs = real(logits, t)
        views = [prop.views[s.seq_id] for s in seqs][: logits.shape[0]]
        built = SamplingTensors.build(
            temperature=[0.8, 1.2][: len(views)], top_k=[0] * len(views),
            top_p=[1.0] * len(views), seeds=[v.seed for v in views],
            positions=[v.num_tokens for v in views], device="cpu",
        )  # fmt: skip
        assert torch.equal(tokens, sample(logits, built))
        return tokens, probs

    monkeypatch.setattr(speculative, "sample_with_probs", spy)
    entries = [ScheduledSeq(s, 1) for s in seqs]
    prop.propose(entries, [3, 1], [0.8, 1.2])
    assert [len(e.draft_token_ids) for e in entries] == [3, 1]
    assert [p for p, _ in calls] == [[8, 5], [9], [10]]  # the longer row first, one further
    assert entries[0].drafts.probs.shape[0] == 3 and entries[1].drafts.probs.shape[0] == 1
