"""Lossless speculation on the embedded SmolLM2 (CPU, fp32, greedy): output with n-gram or
draft-model speculation is token-identical to output without it, in three-lane and single-lane
modes, through the AsyncEngine and its lane dispatcher.

Every generated token costs a forward of the 135M model on CPU (a draft-model round costs L
more), so generations are 24 tokens: several speculative rounds per prompt, and the repetitive
prompts give n-gram matches within the first few tokens."""

from __future__ import annotations

import asyncio

import pytest
from helpers import pin_costs

from verifypd.config import EngineConfig, SpecConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW = 24
PROMPTS = [
    "The capital of France is",
    "List the days of the week: Monday, Tuesday,",
    "def fibonacci(n):",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6,",
    "Explain why the sky is blue in one paragraph.",
    "Q: What is 17 times 3?\nA:",
    "Write the alphabet: A B C D E F",
]
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


async def _generate_all(
    config: EngineConfig, pinned: bool = False
) -> tuple[list[list[int]], AsyncEngine]:
    """``pinned``: the goodput policy priced on fixed costs (``helpers.pin_costs``), so its
    decisions do not follow this CPU's timings."""
    engine = AsyncEngine(config)
    if pinned:
        pin_costs(engine.core.costs, engine.core.controller)
    tok = engine.tokenizer

    async def one(i: int, prompt: str) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(f"r{i}", tok.encode(prompt), GREEDY):
            ids += out.new_token_ids
        return ids

    try:
        outs = await asyncio.wait_for(asyncio.gather(*map(one, range(8), PROMPTS)), 300)
        engine.check_integrity()
        assert engine.kv_usage == 0 and engine.num_running == engine.num_waiting == 0
        return outs, engine
    finally:
        await engine.stop()


def _config(lane_mode: str, spec: SpecConfig) -> EngineConfig:
    return EngineConfig(model="default", device="cpu", lane_mode=lane_mode, spec=spec)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return asyncio.run(_generate_all(_config("single", SpecConfig())))[0]


SPECS = {
    "ngram": SpecConfig(method="ngram", controller=False),
    "draft-self": SpecConfig(method="draft", draft_model="default", controller=False),
}


@pytest.mark.parametrize("lane_mode", ["three", "single"])
@pytest.mark.parametrize("name", list(SPECS))
async def test_greedy_speculation_is_token_identical(plain, lane_mode, name):
    outs, engine = await _generate_all(_config(lane_mode, SPECS[name]))
    for prompt, got, want in zip(PROMPTS, outs, plain, strict=True):
        assert got == want, prompt
    spec = engine.core.spec
    assert spec.num_verifies > 0 and spec.num_drafted > 0
    if name == "draft-self":  # the drafter is the target: (almost) every draft is accepted
        assert spec.num_accepted >= 0.9 * spec.num_drafted
    else:  # repetitive prompts give n-gram matches that verify
        assert spec.num_accepted > 0


async def test_prompt_lookup_under_the_goodput_policy_still_speculates(plain):
    """The default policy with prompt lookup: the prompts whose lookups miss count against
    the acceptance estimate (``AcceptanceEstimate.missed``), and the repetitive ones still
    draft and verify; output stays plain greedy's."""
    config = _config("three", SpecConfig(method="ngram"))
    outs, engine = await _generate_all(config, pinned=True)
    assert outs == plain
    spec = engine.core.spec
    assert spec.num_drafted > 0 and spec.num_accepted > 0
    assert engine.core.controller.decisions["speculate"] > 0
