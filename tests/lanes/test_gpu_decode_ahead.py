"""On the GPU: decode-ahead reads each step's input tokens from the last step's sampled ids on the
device, behind it on the decode stream, through the CUDA graphs. The same requests with it off
and on, token for token: prompts of one length that fit one prompt step (FCFS packing: with
``prefill_pack_tokens`` they would go in several steps, and which decode steps run beside which
is timing), so both runs batch identically (the same graphs on the same shapes) and any
difference is a token read from the wrong place or too early. Greedy and seeded sampled
requests, lengths that end while a step is ahead. Run as a script on an H100 at 4118e0a
(docs/peer-vllm.md): 32 of 32 requests identical with dummy Qwen2.5-0.5B and 7B, 112 and 125
steps ahead."""

from __future__ import annotations

import pytest
import torch
from helpers import generate_all

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="decode-ahead overlaps steps only on a GPU stream"
)


async def _run(ahead: bool) -> tuple[list[list[int]], int]:
    engine = AsyncEngine(EngineConfig(
        model="dummy:qwen2.5-0.5b", device="cuda", decode_ahead=ahead,
        cache=CacheConfig(num_blocks=4096), scheduler=SchedulerConfig(prefill_pack_tokens=None),
    ))  # fmt: skip
    params = [SamplingParams(max_tokens=40 + 7 * (i % 5), ignore_eos=True,
                             temperature=0.0 if i % 2 == 0 else 0.8, seed=i)
              for i in range(32)]  # fmt: skip
    prompts = [[100 + (i * 13 + j) % 5000 for j in range(64)] for i in range(32)]
    out = await generate_all(engine, prompts, params)
    return out, engine.dispatcher.num_ahead_steps


async def test_decode_ahead_on_the_gpu_is_token_identical():
    plain, none = await _run(False)
    ahead, num_ahead = await _run(True)
    assert none == 0 and num_ahead > 0
    diverged = [i for i, (a, b) in enumerate(zip(plain, ahead, strict=True)) if a != b]
    assert not diverged, f"requests {diverged} differ with decode-ahead"
