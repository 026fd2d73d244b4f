"""What the decode-ahead tests share (tests/lanes/test_decode_ahead_*.py): the prompts and their
sampling (greedy and seeded, different lengths, some ending while a step ahead is in flight, one
with a penalty), a run of them through an ``AsyncEngine`` with decode-ahead on or off (its tokens
and the steps launched ahead, every block back), and request A prefilled with its first decode
step left in flight."""

from __future__ import annotations

import asyncio

from helpers import assert_engine_clean, collect, tiny_config

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import Observer, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7] * 40, list(range(10, 60)), [9, 8, 7],
           list(range(100, 130)), [4, 4, 5, 5, 6, 6]]  # fmt: skip


def _params(i: int, stop_token: int | None = None) -> SamplingParams:
    """Greedy and seeded sampling, different lengths (some end while a step ahead is in
    flight), one request with a penalty (never planned ahead: it rides as an ordinary entry)."""
    kw = {"max_tokens": 9 + 4 * i, "ignore_eos": True}
    if i % 2:
        kw.update(temperature=0.9, seed=11 + i)
    else:
        kw.update(temperature=0.0)
    if i == 4:
        kw.update(frequency_penalty=0.5)
    if stop_token is not None and i == 1:
        kw.update(stop_token_ids=[stop_token])
    return SamplingParams(**kw)


class AheadCounter(Observer):
    def __init__(self) -> None:
        self.steps = 0

    def decode_ahead(self) -> None:
        self.steps += 1


async def _run(ahead: bool, stop_token: int | None = None) -> tuple[list[list[int]], int]:
    counter = AheadCounter()
    engine = AsyncEngine(tiny_config(decode_ahead=ahead), observer=counter)
    jobs = [collect(engine, f"r{i}", p, _params(i, stop_token)) for i, p in enumerate(PROMPTS)]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        assert_engine_clean(engine)  # every block back, including those of steps ahead
        await engine.stop()
    assert counter.steps == engine.dispatcher.num_ahead_steps  # the metric's hook
    return out, engine.dispatcher.num_ahead_steps


QUIET = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculate=False)


async def _a_in_flight(engine: AsyncEngine) -> None:
    """Request A (may not speculate) prefilled, its first decode step left in flight."""
    d = engine.dispatcher
    engine.core.add_request("A", [1, 2, 3, 4, 5], QUIET)
    for _ in range(20):
        await d.tick()
        if "decode" in d.in_flight:
            break
    assert "decode" in d.in_flight and d.ahead.step is None
