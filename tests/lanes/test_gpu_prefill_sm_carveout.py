"""On the GPU: ``EngineConfig.prefill_sm_carveout`` with torch's real settings. A prompt step's
logits are the same with its GEMMs on fewer SMs (cuBLASLt, SM count target lowered), and the
engine with the carve-out serves prompts arriving beside running decode rows to the plain
engine's tokens (``dummy:tiny`` in fp32, greedy), enqueueing them carved, with nothing leaked
and the process's BLAS settings back as they were."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from helpers import assert_engine_clean

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.lanes.executor import gemm_sm_carveout
from verifypd.types import SamplingParams, StepPlan

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="cuBLAS's SM carve-out exists on a GPU only"
)


def _blas_settings() -> tuple:
    return torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()


def test_a_prompt_steps_logits_do_not_change_with_the_carveout() -> None:
    core = EngineCore(EngineConfig(model="dummy:qwen2.5-0.5b", device="cuda",
                                   cache=CacheConfig(num_blocks=256)))  # fmt: skip
    core.add_request("p", [100 + i % 5000 for i in range(1024)], SamplingParams(max_tokens=1))
    plan = StepPlan("prefill", core.scheduler.plan_prefill(1024, 8))
    inputs = core.runner.prepare(plan)
    plain = core.runner.forward(inputs, inputs.sample_rows).float()
    before = _blas_settings()
    with gemm_sm_carveout(32):
        carved = core.runner.forward(inputs, inputs.sample_rows).float()
    after = _blas_settings()
    assert after == before
    scale = plain.abs().max().item()
    assert (carved - plain).abs().max().item() <= 2e-2 * scale  # bf16: other kernels, same sums


def _config(carveout: int) -> EngineConfig:
    return EngineConfig(
        model="dummy:tiny", device="cuda", dtype="float32", prefill_slice_layers=1,
        prefill_sm_carveout=carveout, prompt_graph_tokens=0,
        prefill_sm_carveout_in_backlog=True,  # carved with the eight prompts queued too
        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=1024, max_prefill_chunk=128,
                                  max_num_batched_tokens=256),
        cache=CacheConfig(num_blocks=1024, enable_prefix_caching=False),
    )  # fmt: skip


async def _run(carveout: int) -> tuple[list[list[int]], int]:
    engine = AsyncEngine(_config(carveout))
    rng = np.random.default_rng(1)
    lengths = [32] * 4 + [int(n) for n in rng.integers(200, 600, 8)]
    prompts = [rng.integers(0, 500, n).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=400 if i < 4 else 32, ignore_eos=True, temperature=0.0)
              for i in range(12)]  # fmt: skip
    decoding = asyncio.Event()  # the four long generations have tokens: rows are decoding

    async def one(i: int) -> list[int]:
        if i >= 4:
            await decoding.wait()  # the long prompts arrive while the four rows decode
        out: list[int] = []
        async for delta in engine.generate(f"r{i}", prompts[i], params[i]):
            out += delta.new_token_ids
            if i < 4 and len(out) >= 8:
                decoding.set()
        return out

    try:
        out = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(12))), 300)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    return out, engine.executor.num_carved


def test_prompts_beside_decode_rows_run_carved_to_the_plain_tokens() -> None:
    before = _blas_settings()
    plain, none = asyncio.run(_run(0))
    carved, num_carved = asyncio.run(_run(32))
    assert none == 0 and num_carved > 0
    diverged = [i for i, (a, b) in enumerate(zip(plain, carved, strict=True)) if a != b]
    assert not diverged, f"requests {diverged} differ with the carve-out"
    after = _blas_settings()
    assert after == before
