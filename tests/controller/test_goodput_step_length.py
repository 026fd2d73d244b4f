"""How long the goodput policy lets a speculating step be: the step cap (``max_step_ratio``),
which bounds the step itself (a catch-up round's context feed included), and the tail tolerance
(``tail_tolerance``), which gives up at most that share of tokens/s for a shorter step."""

import pytest
from goodput_helpers import Shape, _add, _policy, _teach, _views
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.config import SpecConfig
from verifypd.controller import GoodputConfig, SeqView


def test_the_step_cap_bounds_the_speculating_step_itself():
    """The guard bounds the expected time per token; the cap bounds the step (the gap a
    request sees when its first draft is rejected): with it, L shrinks until the step fits."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3)
    decisions = {}
    for cap in (None, 1.25):
        policy = _policy(shape, max_step_ratio=cap)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.9)
        decisions[cap] = policy.decide(_views(ids))
    free, capped = decisions[None], decisions[1.25]
    assert free.draft_len > capped.draft_len > 0
    assert free.predicted_step_s > 1.25 * free.plain_step_s
    assert capped.predicted_step_s <= 1.25 * capped.plain_step_s


def test_the_step_cap_counts_a_catch_up_rounds_context_feed():
    """A catch-up round's one-off feed is part of the step every row of it waits for: under a
    cap that the round's drafts at L = 4 fit but not with the feed, L shrinks until the whole
    step fits."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.2e-3, prefill_token=20e-6)
    decisions = {}
    for cap in (None, 1.3):
        policy = _policy(shape, max_step_ratio=cap, max_catch_up=64, catch_up_every_steps=1,
                         chunk_catch_up=520, rider_slack=5.0)  # fmt: skip
        ids = _add(policy, 5)
        for i in ids:
            _teach(policy, i, 0.9)
        decisions[cap] = policy.decide(_views(ids[:4]) + [SeqView(4, 300)])
    free, capped = decisions[None], decisions[1.3]
    assert free.reason == "catch_up" and free.draft_lens[4] > 0
    assert free.predicted_step_s > 1.3 * free.plain_step_s  # its 300 tokens tip it over
    assert 0 < capped.draft_len < free.draft_len
    assert capped.predicted_step_s <= 1.3 * capped.plain_step_s


def test_tail_tolerance_takes_the_shortest_step_among_plans_close_to_the_best():
    """A rejected first draft makes the whole step one request's inter-token gap: with a
    tolerance the policy gives up at most that fraction of tokens/s for a shorter step, and
    with none it keeps the best tokens/s. An H200-like shape at light load: α̂ ≈ 0.73 gains
    4 % tokens/s from L = 3 over L = 2 for a step 13 % longer."""
    shape = Shape(fixed=3.9e-3, per_token=5e-6, draft=0.63e-3)
    out = {}
    for tol in (0.0, 0.05, 0.10, 0.5):
        policy = _policy(shape, tail_tolerance=tol)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.75, verifies=200)
        out[tol] = policy.decide(_views(ids))
    best = out[0.0]
    rate = {tol: d.predicted_tokens / d.predicted_step_s for tol, d in out.items()}
    assert best.draft_len == 3 and best.reason == "speculate"
    for tol in (0.05, 0.10):
        d = out[tol]
        assert d.reason == "speculate" and 0 < d.draft_len < best.draft_len
        assert d.predicted_step_s < best.predicted_step_s
        assert rate[tol] >= (1.0 - tol) * rate[0.0]
    assert out[0.10].draft_len <= out[0.05].draft_len
    # However loose the tolerance, a plan must still beat plain decoding by the gain margin.
    assert rate[0.5] > 1.02 * 4 / out[0.5].plain_step_s


@given(
    alphas=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=12),
    tol=st.floats(0.0, 0.5),
)
@settings(max_examples=60, deadline=None)
def test_tail_tolerance_never_leaves_the_tolerance_band(alphas, tol):
    """Property: the tolerant choice speculates exactly when the plain choice does, with a
    step no longer and tokens/s within the tolerance of it."""
    shape = Shape(fixed=3.9e-3, per_token=5e-6, draft=0.63e-3)
    decided = []
    for t in (0.0, tol):
        policy = _policy(shape, tail_tolerance=t)
        ids = _add(policy, len(alphas))
        for i, a in zip(ids, alphas, strict=True):
            _teach(policy, i, a, verifies=60, seed=i)
        decided.append(policy.decide(_views(ids)))
    plain, tolerant = decided
    assert (plain.draft_len > 0) == (tolerant.draft_len > 0)
    if plain.draft_len:
        assert tolerant.predicted_step_s <= plain.predicted_step_s + 1e-12
        plain_rate = plain.predicted_tokens / plain.predicted_step_s
        tolerant_rate = tolerant.predicted_tokens / tolerant.predicted_step_s
        assert tolerant_rate >= (1.0 - tol) * plain_rate - 1e-9


def test_tail_tolerance_is_checked():
    with pytest.raises(ValueError, match="tail_tolerance"):
        GoodputConfig(tail_tolerance=1.0)
    with pytest.raises(ValueError, match="tail_tolerance"):
        SpecConfig(tail_tolerance=-0.1)
