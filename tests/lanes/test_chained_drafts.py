"""Drafts chained behind each verify (``SpecConfig.chain_drafts``), forced on on CPU: the next
round is drafted from the verify's accepted count before the host has seen it, and adopted by
the next proposal. With a drafter that only sometimes agrees with the target (every accepted
count from 0 to L occurs), output stays token-identical to plain greedy decoding, the chained
drafts are the drafts a fresh proposal would make (same acceptance, step by step). (Aborts
with chains in flight: ``test_async_engine.py``.)"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from helpers import generate_all, tiny_config, tiny_draft_spec

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7] * 40, list(range(10, 60)), [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _engine(
    lane_mode: str, chain: bool, controller: bool = False, policy: str = "goodput", **kw
) -> AsyncEngine:
    spec = tiny_draft_spec(controller=controller, chain_drafts=chain, policy=policy)
    cfg = tiny_config(lane_mode=lane_mode, spec=spec, **kw)
    engine = AsyncEngine(cfg)
    _perturb_drafter(engine)
    return engine


def _perturb_drafter(engine: AsyncEngine, noise: float = 0.1) -> None:
    """The drafter starts as a copy of the target; noise makes it disagree now and then."""
    target = engine.core.loaded.model
    drafter = engine.core.spec.drafter.runner.model
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for pd, pt in zip(drafter.parameters(), target.parameters(), strict=True):
            pd.copy_(pt + noise * pt.std() * torch.randn(pt.shape, generator=gen))


async def _run_all(engine: AsyncEngine, params=GREEDY, counts: Counter | None = None):
    record = engine.core.spec.record

    def spy(entry, new_ids):
        if counts is not None:
            counts[(len(entry.draft_token_ids), len(new_ids) - 1)] += 1
        return record(entry, new_ids)

    engine.core.spec.record = spy
    return await generate_all(engine, PROMPTS, params)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    cfg = tiny_config(lane_mode="single")
    return asyncio.run(_run_all_plain(AsyncEngine(cfg)))


async def _run_all_plain(engine: AsyncEngine) -> list[list[int]]:
    async def one(rid, prompt):
        return [t async for out in engine.generate(rid, prompt, GREEDY) for t in out.new_token_ids]

    try:
        return await asyncio.wait_for(asyncio.gather(*map(one, "abcd", PROMPTS)), 120)
    finally:
        await engine.stop()


@pytest.mark.parametrize("lane_mode", ["three", "single"])
async def test_chained_drafts_are_lossless_and_equal_fresh_proposals(reference, lane_mode):
    chained, fresh = Counter(), Counter()
    engine = _engine(lane_mode, chain=True)
    got = await _run_all(engine, counts=chained)
    assert got == reference
    drafter = engine.core.spec.drafter
    assert drafter.num_adopted > 0  # rounds really came from chained drafts
    accepted = {k for (_, k) in chained}
    assert accepted == {0, 1, 2, 3, 4}  # every accepted count, partial ones too
    plain = _engine(lane_mode, chain=False)
    assert await _run_all(plain, counts=fresh) == reference
    assert plain.core.spec.drafter.num_adopted == 0
    # Same drafts, so the same (L, accepted) for every verify, round by round.
    assert chained == fresh


async def test_chained_drafts_with_the_controller_stay_lossless(reference):
    engine = _engine("three", chain=True, controller=True)
    assert await _run_all(engine) == reference
    assert engine.core.spec.num_verifies > 0


async def test_sampled_requests_chain_and_sample_what_fresh_proposals_sample():
    """Sampled drafting chains too (its noise at positions found on the device after the
    verify): seeded requests get the same tokens with chaining as without, from the same
    rounds, and rounds really came from chained drafts."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    outs, counts, adopted = {}, {}, {}
    for chain in (True, False):
        engine = _engine("three", chain=chain)
        counts[chain] = Counter()
        outs[chain] = await _run_all(engine, params, counts[chain])
        adopted[chain] = engine.core.spec.drafter.num_adopted
    assert [len(o) for o in outs[True]] == [16] * len(PROMPTS)
    assert outs[True] == outs[False]
    assert adopted[True] > 0 and adopted[False] == 0
    assert counts[True] == counts[False]  # the same (L, accepted) for every verify


async def test_the_controller_learns_draft_costs_from_chains_not_from_adoptions(reference):
    """An adopting proposal drafts nothing (its drafts were made behind the verify, and timed
    there): only chains and proposals that drafted rows themselves report a drafting cost."""
    engine = _engine("three", chain=True, controller=True, policy="feedback")
    drafter, controller = engine.core.spec.drafter, engine.core.controller
    counts = Counter()
    chain, propose, observe = drafter.chain, drafter.propose, controller.observe_step

    def chain_spy(*args):
        rows = chain(*args)
        counts["timed"] += rows > 0
        return rows

    def propose_spy(entries, *args):
        propose(entries, *args)
        counts["adoption only"] += bool(drafter.last_adopted) and all(
            id(e) in drafter.last_adopted for e in entries if e.draft_token_ids
        )
        counts["timed"] += any(
            id(e) not in drafter.last_adopted for e in entries if e.draft_token_ids
        )

    def observe_spy(lane, *args):
        counts["observed"] += lane == "draft"
        return observe(lane, *args)

    decide = controller.step

    def speculate_always():
        # The controller's L follows measured step costs (wall clock): on a loaded machine it
        # may not speculate at all. The property here is about timing, not about L: keep its
        # bookkeeping, hand every request the longest L.
        max_len = engine.core.config.spec.max_draft_len
        return dict.fromkeys(decide(), max_len)

    drafter.chain, drafter.propose, controller.observe_step = chain_spy, propose_spy, observe_spy
    controller.step = speculate_always
    assert await _run_all(engine) == reference
    assert counts["adoption only"] > 5 and counts["observed"] > 5
    assert counts["observed"] <= counts["timed"]
