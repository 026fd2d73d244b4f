"""Riders on simulated time: rows that decode plainly in a speculating step. The rider bound,
waiting riders (a drafter far behind between catch-up rounds, or being fed its prompt) exempt
from it for at most their limit, a row's second token, a request at its last token riding
outside the guard, and drafts beside the decode step keeping riders at their own step."""

import pytest
from goodput_helpers import Shape, _add, _policy, _teach, _views

from verifypd.config import SpecConfig
from verifypd.controller import GoodputConfig, SeqView


@pytest.mark.parametrize("exempt", [False, True])
def test_riders_waiting_for_their_catch_up_round_ride_when_exempt(exempt):
    """A fresh request (drafter far behind) between catch-up rounds is a rider: under the
    rider bound it keeps the batch plain; exempt, the others speculate and it rides."""
    policy = _policy(waiting_riders_exempt=exempt)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(3, 500)]).reason == "catch_up"  # next round in 8 steps
    d = policy.decide([SeqView(0, 1), SeqView(1, 1), SeqView(2, 1), SeqView(3, 500)])
    if exempt:
        assert d.reason == "speculate" and d.draft_lens[3] == 0
        assert all(d.draft_lens[i] > 0 for i in (0, 1, 2))
    else:
        assert d.reason == "no_gain" and not any(d.draft_lens.values())


@pytest.mark.parametrize("plain", [False, True])
def test_a_rows_second_token_waits_for_no_drafts_when_set(plain):
    """A row fresh from its prompt step (its next token is its second), its drafter far behind:
    exempt as a waiting rider, it rides the others' round (its second token waits for their
    drafts); with ``second_token_plain`` it rides inside the rider bound, so the step is
    plain, and from its next step on it is an exempt waiting rider. A fresh row within reach
    of its drafter does not speculate in that step either."""
    policy = _policy(waiting_riders_exempt=True, second_token_plain=plain)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(3, 500)]).reason == "catch_up"  # the next round in 8 steps
    steady = [SeqView(0, 1), SeqView(1, 1), SeqView(2, 1)]
    d = policy.decide([*steady, SeqView(3, 500, fresh=True)])
    if plain:
        assert d.reason == "no_gain" and not any(d.draft_lens.values())
    else:
        assert d.reason == "speculate" and d.draft_lens[3] == 0 and d.draft_lens[0] > 0
    after = policy.decide([*steady, SeqView(3, 500)])
    assert after.reason == "speculate" and after.draft_lens[3] == 0 and after.draft_lens[0] > 0
    near = policy.decide([*steady, SeqView(3, 1, fresh=True)])
    if plain:
        assert near.reason == "no_gain" and not any(near.draft_lens.values())
    else:
        assert near.reason == "speculate" and near.draft_lens[3] > 0


@pytest.mark.parametrize("limit", [None, 3])
def test_a_waiting_rider_is_exempt_for_at_most_its_limit(limit):
    """A fresh request whose catch-up round does not come (one every 100 steps) rides in the
    others' rounds outside the rider bound, for ``waiting_rider_max_steps`` decisions at most:
    then the bound holds for it again and the batch decodes plainly; once caught up it is a
    candidate, and a later wait starts its count afresh."""
    policy = _policy(waiting_riders_exempt=True, catch_up_every_steps=100,
                     waiting_rider_max_steps=limit)  # fmt: skip
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(3, 500)]).reason == "catch_up"  # the next round in 100 steps
    batch = [SeqView(0, 1), SeqView(1, 1), SeqView(2, 1), SeqView(3, 500)]
    reasons = [policy.decide(batch).reason for _ in range(6)]
    if limit is None:
        assert reasons == ["speculate"] * 6
    else:
        assert reasons == ["speculate"] * 3 + ["no_gain"] * 3
    assert policy.decide(_views(ids)).reason == "speculate"  # caught up: no longer waiting
    assert policy.decide(batch).reason == "speculate"  # waiting again: counted afresh


def test_a_request_at_its_last_token_rides_along_outside_the_guard():
    policy = _policy()
    ids = _add(policy, 3)
    for i in ids:
        _teach(policy, i, 0.9)
    d = policy.decide([SeqView(0), SeqView(1), SeqView(2, tokens_left=1)])
    assert d.reason == "speculate" and d.draft_lens[0] == d.draft_lens[2] == d.draft_len > 0


def test_a_row_whose_drafter_is_being_fed_decodes_plainly_as_a_waiting_rider():
    """A row whose drafter is being fed its prompt behind the prefill (``drafter_busy``) is no
    candidate; it rides along plainly and, like a row waiting for its catch-up round, outside
    the rider bound when ``waiting_riders_exempt`` (it speculates once fed)."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3)
    out = {}
    for exempt in (False, True):
        policy = _policy(shape, waiting_riders_exempt=exempt, rider_slack=0.05)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.9)
        out[exempt] = policy.decide(_views(ids[:3]) + [SeqView(3, 1, drafter_busy=True)])
    assert out[True].reason == "speculate" and out[True].draft_lens[3] == 0
    assert all(out[True].draft_lens[i] > 0 for i in range(3))
    assert out[False].draft_len == 0  # a plain rider may not wait a whole round
    policy = _policy(shape)
    _add(policy, 1)
    _teach(policy, 0, 0.9)
    assert policy.decide([SeqView(0, 1, drafter_busy=True)]).reason == "no_candidates"


@pytest.mark.parametrize("beside", [False, True])
def test_drafts_beside_the_decode_step_let_riders_wait_for_their_own_step_only(beside):
    """Four requests that accept 0.9 beside four that may not speculate: drafted ahead of the
    decode step, every plan makes the plain four wait past the rider bound; drafted beside it
    (on the verify lane's stream), a separate round keeps them at their own decode step."""
    policy = _policy(drafts_beside_decode=beside, rider_slack=0.05)
    spec = _add(policy, 4)
    plain = _add(policy, 4, start=4, speculate=False)
    for i in spec:
        _teach(policy, i, 0.9)
    d = policy.decide(_views(spec + plain))
    if not beside:
        assert d.reason == "no_gain"
        return
    assert d.reason == "speculate" and not d.fused
    assert all(d.draft_lens[i] == d.draft_len > 0 for i in spec)
    assert all(d.draft_lens[i] == 0 for i in plain)
    # the round is still charged in full: drafts, the plain rows' step and the verify
    costs = policy.costs
    full = d.draft_len * costs.draft(4) + costs.decode(4) + costs.verify(4, 1 + d.draft_len)
    assert d.predicted_step_s == pytest.approx(full, rel=0.05)


@pytest.mark.parametrize("bad", [0, -3, 1.5])
def test_waiting_rider_max_steps_is_validated(bad):
    with pytest.raises(ValueError, match="waiting_rider_max_steps"):
        SpecConfig(waiting_rider_max_steps=bad)
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="waiting_rider_max_steps"):
            GoodputConfig(waiting_rider_max_steps=bad)
