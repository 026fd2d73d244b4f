"""On the GPU: speculation across the lanes' CUDA streams reads the right drafts.

The drafts stay on the device: the drafter runs on the decode stream, and the verify, on its
own stream, is launched before the drafter has finished; it must wait for the drafts on the
GPU. Three-lane mode (separate streams) and single-lane mode (one stream) run the same steps
one request at a time, the same kernels on the same shapes (no prompt graphs), so any token
that differs is a draft read too early (or memory reused under it). Greedy and seeded sampled
requests both."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="lane streams exist only on a GPU"
)


async def _run(
    lane_mode: str, prompts, params, beside: bool = False
) -> tuple[list[list[int]], int]:
    spec = SpecConfig(method="draft", draft_model="dummy:tiny", max_draft_len=4,
                      initial_draft_len=4, controller=False,
                      drafts_beside_decode=beside)  # fmt: skip
    # No prompt graphs: the single lane runs prompts in mixed steps, and a prompt graph's rows
    # padded to 256 give bf16 sums another order (in fp32 the tokens match with them too).
    engine = AsyncEngine(EngineConfig(
        model="dummy:tiny", device="cuda", lane_mode=lane_mode, spec=spec, cuda_graphs=True,
        prompt_graph_tokens=0,
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=1024),
        cache=CacheConfig(num_blocks=256, enable_prefix_caching=False),
    ))  # fmt: skip
    outputs = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            ids: list[int] = []
            async for out in engine.generate(f"r{i}", prompt, p):
                ids += out.new_token_ids
            outputs.append(ids)
        engine.check_integrity()
        assert engine.kv_usage == 0
        return outputs, engine.core.spec.num_verifies
    finally:
        await engine.stop()


@pytest.mark.parametrize("beside", [False, True], ids=["drafts-ahead", "drafts-beside"])
def test_three_lanes_on_streams_match_one_stream(beside):
    """``beside``: the drafts are made on the verify lane's stream (drafts_beside_decode)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, int(rng.integers(3, 200))).tolist() for _ in range(10)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0) for _ in range(6)]
    params += [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, seed=i)
               for i in range(4)]  # fmt: skip
    three, verifies = asyncio.run(_run("three", prompts, params, beside))
    single, _ = asyncio.run(_run("single", prompts, params))
    assert verifies > 50  # speculation ran
    assert three == single, [_first_diff(x, y) for x, y in zip(three, single, strict=True)]


def _first_diff(x: list[int], y: list[int]) -> int | None:
    return next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
