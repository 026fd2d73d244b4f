"""A proposer that finds nothing to draft (prompt lookup without a match) is heard by the
policy: the round it was planned as gave one token, as a round whose first draft is rejected,
so a request whose lookups keep missing stops being planned as a speculator (and its plain
steps can be planned ahead again)."""

from types import SimpleNamespace

from goodput_helpers import _add, _policy, _views

from verifypd.config import EngineConfig, SpecConfig
from verifypd.controller.signals import AcceptanceEstimate
from verifypd.types import SamplingParams, ScheduledSeq, Sequence


def test_a_miss_counts_as_a_first_draft_rejected():
    missed, rejected = AcceptanceEstimate(0.1, 0.7), AcceptanceEstimate(0.1, 0.7)
    missed.missed()
    rejected.update(3, 0)
    assert missed.value == rejected.value < 0.7
    assert (missed.num_updates, missed.num_drafted, missed.num_accepted) == (1, 0, 0)


def test_misses_alone_park_a_request_and_the_population():
    """Lookups that never match: the policy plans rounds at first (its prior pays), and after
    the misses no more, apart from backed-off probes."""
    policy = _policy(probe_min_steps=16, probe_max_steps=1024)
    ids = _add(policy, 4)
    first = policy.decide(_views(ids)).draft_lens
    assert any(first.values())  # the prior pays: it plans a round
    planned = 0
    for _ in range(2000):
        lens = policy.decide(_views(ids)).draft_lens
        for i in (i for i, n in lens.items() if n):
            planned += 1
            policy.observe_miss(i)
    assert policy.population.value < 0.1
    assert all(policy.acceptance(i) < 0.1 for i in ids)
    assert 0 < planned <= 100  # the first rounds and a few probes, not 4 a step (8,000)
    assert policy.snapshot()["probe_interval"] == 1024


def test_hits_between_misses_keep_a_request_speculating():
    """Half the lookups match and every draft is kept: α̂ stays high enough to pay."""
    policy = _policy()
    ids = _add(policy, 2)
    for step in range(400):
        for i, n in policy.decide(_views(ids)).draft_lens.items():
            if n and step % 2:
                policy.observe_miss(i)
            elif n:
                policy.observe_acceptance(i, n, n)
    assert all(policy.draft_length(i) or policy.acceptance(i) > 0.5 for i in ids)
    assert any(policy.decide(_views(ids)).draft_lens.values())


def test_the_engine_reports_a_lookup_without_a_match():
    """``SpecConfig.method`` "ngram": an entry given L > 0 whose lookup finds nothing is marked
    and, once its step lands, reported to the policy (its α̂ falls); one whose lookup matches
    is reported as a verify."""
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=SpecConfig("ngram")))
    policy = SpeculationPolicy(core)
    no_match = Sequence("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    match = Sequence("b", [5, 6, 7, 5], SamplingParams(max_tokens=8))
    for seq in (no_match, match):
        policy.request_added(seq)
    entries = [ScheduledSeq(no_match, 1, draft_len=2), ScheduledSeq(match, 1, draft_len=2)]
    core.spec.propose(entries)
    assert entries[0].draft_missed and entries[0].draft_token_ids == []
    assert not entries[1].draft_missed and entries[1].draft_token_ids == [6, 7]
    ctl = policy.controller
    before = ctl.acceptance(no_match.seq_id)
    seen = []
    core.observer.draft_missed = lambda: seen.append("miss")  # /metrics' spec_draft_misses
    core.observer.spec_tokens = lambda drafted, accepted: seen.append((drafted, accepted))
    core._record_acceptance(SimpleNamespace(seqs=entries), [[9], [6, 7, 8]])
    assert ctl.acceptance(no_match.seq_id) < before
    assert ctl.acceptance(match.seq_id) > before
    assert core.spec.num_drafted == 2  # the miss drafted nothing
    assert seen == ["miss", (2, 2)]
