"""Signal trackers: exact values on simulated time."""

import math

import pytest
from controller_sim import FakeClock, PatternOracle
from hypothesis import example, given, settings
from hypothesis import strategies as st

from verifypd.controller import AcceptanceEstimate, Ewma, StepCostModel, WindowPercentile


def test_ewma_first_update_sets_value_then_smooths():
    e = Ewma(0.25)
    assert e.value is None
    assert e.update(8.0) == 8.0
    assert e.update(0.0) == 6.0  # 8 + 0.25·(0 − 8)
    assert Ewma(0.5, initial=2.0).update(4.0) == 3.0


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5])
def test_ewma_rejects_bad_weight(weight):
    with pytest.raises(ValueError):
        Ewma(weight)


def test_acceptance_prior_and_exact_updates():
    a = AcceptanceEstimate(0.3, prior=0.8)
    assert a.value == pytest.approx(0.8)
    a.update(4, 4)  # K = 4 of n = 4 tested
    assert a.value == pytest.approx((0.7 * 0.8 + 0.3 * 4) / (0.7 * 1 + 0.3 * 4))
    a.update(4, 1)  # K = 1, stopped at a rejection: n = 2
    k = 0.7 * (0.7 * 0.8 + 1.2) + 0.3 * 1
    n = 0.7 * (0.7 + 1.2) + 0.3 * 2
    assert a.value == pytest.approx(k / n)
    assert (a.num_drafted, a.num_accepted) == (8, 5)


def test_acceptance_ignores_empty_verify_and_rejects_impossible_counts():
    a = AcceptanceEstimate(0.3, prior=0.5)
    a.update(0, 0)
    assert a.value == 0.5 and a.num_drafted == 0
    with pytest.raises(ValueError):
        a.update(2, 3)


def test_acceptance_is_per_token_not_accepted_over_drafted():
    """α = 0.5 at L = 4: K/L averages 0.25, α̂ converges to the per-token 0.5."""
    a, oracle = AcceptanceEstimate(0.3, prior=0.8), PatternOracle([1, 0])
    for _ in range(100):
        a.update(4, oracle.verify(4))
    assert a.value == pytest.approx(0.5)
    assert a.num_accepted / a.num_drafted == pytest.approx(0.25)


def test_window_percentile_nearest_rank():
    w = WindowPercentile(10.0, FakeClock())
    assert w.percentile(95) is None and w.count == 0
    for v in range(100, 0, -1):
        w.add(float(v))
    assert (w.percentile(0), w.percentile(50), w.percentile(95), w.percentile(100)) == (
        1.0,
        50.0,
        95.0,
        100.0,
    )
    assert w.percentile(95.5) == 96.0  # rank ⌈95.5⌉ = 96
    with pytest.raises(ValueError):
        w.percentile(101)


def test_window_percentile_forgets_by_time():
    clock = FakeClock()
    w = WindowPercentile(5.0, clock)
    w.add(9.0)  # t = 0
    clock.advance(3.0)
    w.add(1.0)  # t = 3
    clock.advance(2.0)  # t = 5: the first sample is exactly window_s old, still in
    assert (w.count, w.percentile(100)) == (2, 9.0)
    clock.advance(0.5)
    assert (w.count, w.percentile(100)) == (1, 1.0)
    clock.advance(3.0)
    assert (w.count, w.percentile(50)) == (0, None)


def test_window_percentile_caps_samples():
    w = WindowPercentile(5.0, FakeClock(), max_samples=3)
    for v in (5.0, 1.0, 2.0, 3.0):
        w.add(v)
    assert (w.count, w.percentile(100)) == (3, 3.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 1.0), st.sampled_from([1.0, 2.0, 2.0, 3.5, 7.0])),
        max_size=60,
    ),
    st.integers(1, 8),
    st.sampled_from([5.0, 50.0, 95.0, 100.0]),
)
# A sample exactly at the window's edge after rounding (found by CI's run of this test at
# 4c2a143: the window compared t < now - window_s, which drops it).
@example(steps=[(0.9999999999999999, 1.0), (1.0, 2.0), (1.0, 2.0)], cap=3, q=5.0)
def test_window_percentile_matches_sorting_the_window(steps, cap, q):
    """The incrementally sorted window gives what sorting the kept samples gives, through
    expiry, the sample cap and repeated values."""
    clock = FakeClock()
    w = WindowPercentile(2.0, clock, max_samples=cap)
    kept: list[tuple[float, float]] = []
    for dt, value in steps:
        clock.advance(dt)
        w.add(value)
        kept = [*kept, (clock.t, value)][-cap:]
        live = sorted(v for t, v in kept if clock.t - t <= 2.0)
        want = live[max(1, math.ceil(q / 100.0 * len(live))) - 1] if live else None
        assert w.percentile(q) == want


def test_cost_model_priors_are_relative_to_decode():
    m = StepCostModel(prior_decode_s=2e-3, prior_verify_token_frac=0.1, prior_draft_frac=0.2)
    assert m.decode_cost() == 2e-3
    assert m.verify_line() == pytest.approx((1.8e-3, 0.2e-3))
    assert m.draft_cost() == pytest.approx(0.4e-3)
    m.observe("decode", 0.032, num_seqs=32, num_tokens=32)  # d = 1 ms
    assert m.decode_cost() == pytest.approx(1e-3)
    assert m.verify_cost(0) == pytest.approx(1e-3)  # a₀ + b₀ = d
    assert m.verify_cost(4) == pytest.approx(0.9e-3 + 0.1e-3 * 5)
    assert m.draft_cost() == pytest.approx(0.2e-3)


def test_cost_model_ratio_estimates():
    m = StepCostModel(decay=1.0)
    m.observe("decode", 0.010, 10, 10)
    m.observe("decode", 0.030, 20, 20)
    assert m.decode_cost() == pytest.approx(0.040 / 30)
    m.observe("draft", 0.008, 4, 16)  # 16 drafted tokens over 4 sequences
    assert m.draft_cost() == pytest.approx(0.5e-3)


def test_cost_model_fits_verify_line_from_mixed_batches():
    """y = s/B on x = T/B; with x spread and a negligible ridge the fit is the true line."""
    m = StepCostModel(decay=1.0, slope_prior_weight=1e-9)
    a, b = 0.4e-3, 0.25e-3
    for num_seqs, tokens_per_seq in [(8, 1), (8, 3), (16, 2), (4, 5), (8, 4)]:
        t = num_seqs * tokens_per_seq
        m.observe("verify", num_seqs * (a + b * tokens_per_seq), num_seqs, t)
    assert m.verify_line() == pytest.approx((a, b), rel=1e-6)
    assert m.verify_cost(3) == pytest.approx(a + 4 * b, rel=1e-6)


def test_cost_model_same_length_batches_use_beta_share_slope():
    """Every verify at L = 3 (x = 4): b = β·ȳ / (1 − β + β·x̄), the line passes the data."""
    m = StepCostModel(prior_decode_s=1e-3, prior_verify_token_frac=0.1)
    for _ in range(20):
        m.observe("verify", 8 * 2e-3, num_seqs=8, num_tokens=32)
    a, b = m.verify_line()
    assert b == pytest.approx(0.1 * 2e-3 / (0.9 + 0.4))
    assert a + 4 * b == pytest.approx(2e-3)
    m.observe("decode", 1.0, 1, 1)  # a slow decode step does not move the verify line
    assert m.verify_line() == pytest.approx((a, b))


def test_cost_model_remembers_identified_slope():
    """Once mixed batches identified b, a long run of same-length batches (whose spread decays
    away) keeps it instead of drifting back to the prior."""
    m = StepCostModel(prior_verify_token_frac=0.1, decay=0.9)
    a, b = 0.3e-3, 0.5e-3  # steep: far from the β = 0.1 prior
    for _ in range(30):
        for x in range(1, 6):
            m.observe("verify", a + b * x, 1, x)
    assert m.verify_line() == pytest.approx((a, b), rel=1e-3)
    for _ in range(500):
        m.observe("verify", a + b * 2, 1, 2)
    assert m.verify_line() == pytest.approx((a, b), rel=1e-3)


def test_cost_model_slope_never_negative():
    m = StepCostModel(decay=1.0, slope_prior_weight=1e-9)
    m.observe("verify", 3e-3, 1, 1)
    m.observe("verify", 1e-3, 1, 5)  # noise: more tokens, less time
    a, b = m.verify_line()
    assert b == 0.0 and a > 0.0


def test_cost_model_ignores_empty_steps_and_prefill():
    m = StepCostModel()
    m.observe("decode", 0.5, 0, 0)
    m.observe("prefill", 0.5, 2, 900)
    m.observe("mixed", 0.5, 2, 900)
    assert m.decode_cost() == m.prior_decode_s
    assert m.num_observations == {
        "decode": 0,
        "verify": 0,
        "prefill": 1,
        "draft": 0,
        "mixed": 1,
    }
    with pytest.raises(ValueError):
        m.observe("bogus", 0.1, 1, 1)
    with pytest.raises(ValueError):
        m.observe("decode", -0.1, 1, 1)


def test_a_prior_counted_as_few_observations_fades_fast():
    """prior_count = 4: the first updates are a running mean with the prior as 4 verifies; a
    drafter that accepts nothing parks (< 0.15) after one round of 24 verifies, where the
    plain EWMA (w = 0.02) still believes 0.8 * 0.98^24 / (...) ~ 0.5."""
    pooled, plain = AcceptanceEstimate(0.02, 0.8, prior_count=4), AcceptanceEstimate(0.02, 0.8)
    pooled.update(4, 0)
    assert pooled.value == pytest.approx(0.8 * 4 / 5)
    for _ in range(23):
        pooled.update(4, 0)
        plain.update(4, 0)
    assert pooled.value == pytest.approx(0.8 * 4 / 28) and pooled.value < 0.15
    assert plain.value > 0.4
    # Past 1 / w - prior_count updates the weight is the EWMA's own again.
    e = Ewma(0.25, 1.0, prior_count=1)
    assert [e.update(0.0) for _ in range(3)] == pytest.approx([0.5, 1 / 3, 0.25])
    assert e.update(0.0) == pytest.approx(0.25 * 0.75)
    with pytest.raises(ValueError):
        Ewma(0.1, None, prior_count=2)
