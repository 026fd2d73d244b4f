"""Property tests: random streams of requests, observations, queue depths, latencies and time."""

import math

from controller_sim import FakeClock
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.controller import ControllerConfig, DraftController, FixedController
from verifypd.controller.signals import LANES

SEQ_IDS = st.integers(0, 5)
ADD = st.tuples(st.just("add"), SEQ_IDS, st.booleans(), st.floats(0.0, 2.0), st.booleans())
OBSERVATION = st.one_of(
    ADD,
    st.tuples(st.just("remove"), SEQ_IDS),
    st.tuples(st.just("accept"), SEQ_IDS, st.integers(0, 10), st.floats(0.0, 1.0)),
    st.tuples(st.just("accept"), SEQ_IDS, st.integers(0, 10), st.floats(0.0, 1.0)),
    st.tuples(
        st.just("lane"),
        st.sampled_from(LANES),
        st.floats(0.0, 0.3),
        st.integers(0, 16),
        st.integers(0, 64),
    ),
    st.tuples(st.just("queue"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
)
# A stream: a few requests, then rounds of up to four observations followed by one step.
ROUND = st.lists(OBSERVATION, max_size=4).map(lambda ops: [*ops, ("step",)])
OPS = st.tuples(st.lists(ADD, min_size=1, max_size=4), st.lists(ROUND, max_size=40)).map(
    lambda t: t[0] + [op for r in t[1] for op in r]
)


@st.composite
def configs(draw) -> ControllerConfig:
    max_draft_len = draw(st.integers(0, 8))
    return ControllerConfig(
        max_draft_len=max_draft_len,
        initial_draft_len=draw(st.integers(0, max_draft_len)),
        ewma_alpha=draw(st.sampled_from([0.1, 0.3, 1.0])),
        p95_window_s=draw(st.sampled_from([0.5, 5.0])),
        grow_dwell_steps=draw(st.integers(1, 3)),
        shrink_dwell_steps=draw(st.integers(1, 3)),
        probe_every_steps=draw(st.integers(0, 4)),
        shrink_factor=draw(st.sampled_from([0.0, 0.25, 0.5, 0.75])),
        gain_margin=draw(st.sampled_from([0.0, 0.03, 0.2])),
    )


def _apply(ctrl: DraftController, clock: FakeClock, op: tuple) -> dict[int, int] | None:
    """Feed one op; a step returns its decisions."""
    kind, *args = op
    if kind == "add":
        seq_id, greedy, temperature, speculate = args
        ctrl.add_request(seq_id, greedy, 0.0 if greedy else temperature, speculate)
    elif kind == "remove":
        ctrl.remove_request(args[0])
    elif kind == "accept":
        seq_id, drafted, frac = args
        ctrl.observe_acceptance(seq_id, drafted, math.floor(frac * drafted))
    elif kind == "lane":
        ctrl.observe_step(*args)
    elif kind == "queue":
        ctrl.observe_verify_queue(args[0])
    elif kind == "tick":
        clock.advance(args[0])
    else:
        return ctrl.step()
    return None


def _check_invariants(ctrl: DraftController, decisions: dict[int, int], targets: dict) -> None:
    cfg = ctrl.config
    for seq_id, n in decisions.items():
        greedy, temperature, speculate = targets[seq_id]
        assert 0 <= n <= cfg.max_draft_len
        assert ctrl.draft_length(seq_id) == n
        assert speculate or n == 0
        tau = ctrl.drafter_temperature(seq_id)
        assert 0.0 <= tau <= temperature
        assert not greedy or tau == 0.0
        assert 0.0 <= ctrl.acceptance(seq_id) <= 1.0
    snap = ctrl.snapshot()
    assert sum(snap["draft_len_hist"]) == snap["num_requests"] == len(decisions)


def _check_dynamics(ctrl: DraftController, before: dict[int, int], after: dict[int, int]):
    """Grow by at most 1 per step and only with headroom; under pressure L ≤ ⌊f·L_prev⌋."""
    snap = ctrl.snapshot()
    for seq_id, n in after.items():
        prev = before[seq_id]
        assert n <= prev + 1
        if n > prev:
            assert snap["has_headroom"]
        if snap["pressure"] is not None:
            assert n <= math.floor(ctrl.config.shrink_factor * prev)


@settings(max_examples=150, deadline=None)
@given(configs(), OPS, st.booleans())
def test_decisions_stay_in_bounds(config, ops, fixed):
    clock = FakeClock()
    ctrl = FixedController(config, clock) if fixed else DraftController(config, clock)
    targets: dict[int, tuple[bool, float, bool]] = {}
    for op in ops:
        if op[0] == "add":
            _, seq_id, greedy, temperature, speculate = op
            targets[seq_id] = (greedy, 0.0 if greedy else temperature, speculate)
        before = {s: ctrl.draft_length(s) for s in targets if s in ctrl}
        decisions = _apply(ctrl, clock, op)
        if decisions is None:
            continue
        assert set(decisions) == set(before)
        _check_invariants(ctrl, decisions, targets)
        if not fixed:
            _check_dynamics(ctrl, before, decisions)


def _trace(config: ControllerConfig, ops: list[tuple]) -> list:
    clock = FakeClock(100.0)
    ctrl = DraftController(config, clock)
    trace = []
    for op in ops:
        decisions = _apply(ctrl, clock, op)
        if decisions is not None:
            trace.append(
                (
                    decisions,
                    {s: ctrl.decision_reason(s) for s in decisions},
                    {s: ctrl.drafter_temperature(s) for s in decisions},
                    ctrl.snapshot(),
                )
            )
    return trace


@settings(max_examples=100, deadline=None)
@given(configs(), OPS)
def test_same_inputs_same_decisions(config, ops):
    assert _trace(config, ops) == _trace(config, ops)
