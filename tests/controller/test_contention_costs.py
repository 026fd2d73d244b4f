"""Contended step costs: what decode, verify, mixed and draft steps measure beside prompt work
(levels of their own in ``BatchCostModel``), and the goodput policy pricing its plans with
them while prompt work is in flight (``GoodputConfig.contention_costs``)."""

import pytest
from controller_sim import FakeClock
from goodput_helpers import Shape, _add, _teach, _views

from verifypd.config import SpecConfig
from verifypd.controller import BatchCostModel, GoodputConfig, LoadSignals, build_policy

BUSY, IDLE = LoadSignals(prefill_running=True), LoadSignals(prefill_running=False)


def _observe(costs, kind, factor, times, contended, rows=8, q=1):
    shape = Shape()
    seconds = shape.draft_time(rows) if kind == "draft" else shape.target_time(rows, q)
    for _ in range(times):
        costs.observe(kind, factor * seconds, rows, rows * q, contended)


def test_contended_steps_learn_levels_of_their_own():
    costs = BatchCostModel(Shape(), min_contended=4)
    base = {"decode": costs.decode(8), "verify": costs.verify(8, 5), "draft": costs.draft(8)}
    _observe(costs, "decode", 3.0, 3, contended=True)
    # fewer than min_contended: a contended prediction reads the uncontended level
    assert costs.decode(8, contended=True) == pytest.approx(base["decode"])
    assert costs.snapshot()["contended_decode"] is None
    _observe(costs, "decode", 3.0, 60, contended=True)
    _observe(costs, "verify", 1.5, 60, contended=True, q=5)
    _observe(costs, "draft", 6.0, 60, contended=True)
    assert costs.decode(8, contended=True) == pytest.approx(3 * base["decode"], rel=1e-3)
    assert costs.verify(8, 5, contended=True) == pytest.approx(1.5 * base["verify"], rel=1e-3)
    assert costs.draft(8, contended=True) == pytest.approx(6 * base["draft"], rel=1e-3)
    # catch-up forwards are the drafter's: they read its contended level
    assert costs.catch_up(100, contended=True) == pytest.approx(6 * costs.catch_up(100), rel=1e-3)
    # the GPU to itself is untouched by all of it
    assert costs.decode(8) == pytest.approx(base["decode"])
    assert costs.verify(8, 5) == pytest.approx(base["verify"])
    assert costs.level["target"] == 1.0 and costs.num_observations["decode"] == 0
    snap = costs.snapshot()
    assert snap["contended_decode"] == pytest.approx(3.0, rel=1e-3)
    assert snap["contended_draft"] == pytest.approx(6.0, rel=1e-3)
    assert snap["contended_mixed"] is None
    # a prompt step is the contender: its own time always updates its one level
    costs.observe("prefill", 2 * Shape().prefill_time(512), 1, 512, contended=True)
    assert costs.level["prefill"] == pytest.approx(1.2)


def test_a_contended_level_starts_from_the_uncontended_one():
    costs = BatchCostModel(Shape(), min_contended=1)
    _observe(costs, "decode", 2.0, 60, contended=False)
    _observe(costs, "decode", 4.0, 1, contended=True)  # one step: 2 + 0.2 * (4 - 2)
    assert costs.level_of("decode", contended=True) == pytest.approx(2.4, rel=1e-3)
    with pytest.raises(ValueError):
        BatchCostModel(Shape(), min_contended=0)


def _policy(contention_costs):
    spec = SpecConfig(max_draft_len=4, initial_draft_len=4)
    goodput = GoodputConfig(contention_costs=contention_costs)
    return build_policy(spec, BatchCostModel(Shape(), min_contended=4), goodput, FakeClock())


@pytest.mark.parametrize("contention_costs", [False, True])
def test_beside_prompt_work_a_plan_is_priced_with_contended_costs(contention_costs):
    """Drafter steps that lose most of the GPU to a prompt chunk (sixteen times their time)
    while the target's steps keep theirs: beside prompt work the policy that reads contended
    costs stays plain; with the GPU to itself both speculate."""
    policy = _policy(contention_costs)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    _observe(policy.costs, "decode", 1.0, 30, contended=True)
    _observe(policy.costs, "verify", 1.0, 30, contended=True, q=5)
    _observe(policy.costs, "draft", 16.0, 60, contended=True)
    idle = policy.decide(_views(ids), IDLE)
    busy = policy.decide(_views(ids), BUSY)
    assert idle.reason == "speculate" and idle.draft_len > 0
    if contention_costs:
        assert busy.reason == "no_gain" and not any(busy.draft_lens.values())
    else:
        assert busy.reason == "speculate" and busy.draft_len == idle.draft_len


def test_target_steps_slowed_alike_leave_the_decision_as_it_was():
    """Contention that slows every step by the same factor changes no choice: only the
    difference between steps does."""
    policy = _policy(True)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    idle = policy.decide(_views(ids), IDLE)
    for kind, q in (("decode", 1), ("verify", 5), ("draft", 1)):
        _observe(policy.costs, kind, 2.0, 60, contended=True, q=q)
    busy = policy.decide(_views(ids), BUSY)
    assert (busy.reason, busy.draft_len, busy.fused) == (idle.reason, idle.draft_len, idle.fused)
    assert busy.plain_step_s == pytest.approx(2 * idle.plain_step_s, rel=1e-3)
    assert busy.predicted_step_s == pytest.approx(2 * idle.predicted_step_s, rel=1e-3)


def test_the_engine_reads_prompt_work_for_contention_costs():
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    spec = SpecConfig(method="ngram", contention_costs=True)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core)
    assert policy.reads_prompt_work and policy.controller.goodput.contention_costs


def test_the_engine_marks_a_rows_second_token_for_the_policy():
    """``SpecConfig.second_token_plain`` reaches the goodput policy, and a decodable row with
    one output token and no step in flight is ``fresh`` (its next token is its second); one
    whose second token is in flight (a step planned ahead names it) is not."""
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy
    from verifypd.types import SamplingParams, Sequence

    spec = SpecConfig(method="ngram", second_token_plain=True)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core)
    assert policy.controller.goodput.second_token_plain
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(3)]
    for seq, (out, in_flight) in zip(seqs, [(1, 0), (2, 0), (1, 1)], strict=True):
        seq.token_ids += [4] * out
        seq.in_flight = in_flight
        policy.request_added(seq)
    seen = []
    policy.controller.decide = lambda views, load: seen.extend(views) or _no_decision()
    policy.decide(False, seqs)
    assert [v.fresh for v in seen] == [True, False, False]


def _no_decision():
    from verifypd.controller.goodput import BatchDecision

    return BatchDecision({}, False, "no_gain")


def test_the_policy_snapshot_carries_the_contended_levels():
    """What the benchmarks' policy timelines read (``cost_contended_*``): None until a kind has
    counted, then its level."""
    policy = _policy(True)
    assert policy.snapshot()["cost_contended_draft"] is None
    _observe(policy.costs, "draft", 3.0, 60, contended=True)
    snap = policy.snapshot()
    assert snap["cost_contended_draft"] == pytest.approx(3.0, rel=1e-3)
    assert snap["cost_levels"]["contended_draft"] == snap["cost_contended_draft"]
    assert snap["cost_contended_verify"] is None
