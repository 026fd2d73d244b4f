"""On the GPU: prompt-ahead enqueues the next prompt step on the prefill stream behind the one
in flight, its inputs uploaded and its first layers launched while that one runs. A burst of
prompts of many lengths (the short ones in the prompt graph) with it off and on: each request's
first token, greedy and seeded, must be the same. Each step holds one prompt, in arrival order
(no packing), so both runs compute the same steps whatever the timing, and any difference is an
input or a result overwritten by the step behind."""

from __future__ import annotations

import pytest
import torch
from helpers import generate_all

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a step runs behind another only on a GPU stream"
)

LENGTHS = [1900, 140, 3000, 60, 900, 2500, 200, 1200, 30, 700, 2200, 90]


async def _run(ahead: bool) -> tuple[list[list[int]], int]:
    engine = AsyncEngine(EngineConfig(
        model="dummy:qwen2.5-0.5b", device="cuda", prompt_ahead=ahead,
        cache=CacheConfig(num_blocks=4096), scheduler=SchedulerConfig(prefill_pack_tokens=0),
    ))  # fmt: skip
    params = [SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=i) for i in range(len(LENGTHS))]  # fmt: skip
    prompts = [[100 + (i * 31 + j * 7) % 20000 for j in range(n)] for i, n in enumerate(LENGTHS)]
    out = await generate_all(engine, prompts, params)  # checks the engine clean, stops it
    return out, engine.dispatcher.prompt_ahead.num_steps


async def test_prompt_ahead_on_the_gpu_gives_the_same_first_tokens():
    plain, none = await _run(False)
    ahead, num_ahead = await _run(True)
    assert none == 0 and num_ahead > 0
    diverged = [i for i, (a, b) in enumerate(zip(plain, ahead, strict=True)) if a != b]
    assert not diverged, f"requests {diverged} differ with prompt-ahead"
