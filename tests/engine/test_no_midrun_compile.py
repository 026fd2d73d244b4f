"""On the GPU, no Triton kernel compiles after the engine's start-up warm-up, whatever the
traffic: steps of every kind and size (prefill chunks, plain and speculative decode of
varying draft lengths, the drafter's catch-up) reuse kernels compiled at start. A compile
under traffic stalls every lane for up to a second."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.sync_driver import SyncDriver
from verifypd.types import SamplingParams

triton = pytest.importorskip("triton")
runtime = getattr(getattr(triton, "knobs", None), "runtime", None)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles only on a GPU"),
    pytest.mark.skipif(
        runtime is None or not hasattr(runtime, "jit_cache_hook"), reason="no jit_cache_hook"
    ),
]


@pytest.mark.parametrize("controller", [False, True, None])
def test_no_triton_compile_after_start_up(controller):
    """``controller`` None: no speculation, so the single lane's steps of decode rows and
    prompt chunks split their attention (``split_decode_rows``), at every row count."""
    spec = SpecConfig() if controller is None else SpecConfig(
        method="draft", draft_model="dummy:tiny", max_draft_len=4, initial_draft_len=2,
        controller=controller,
    )  # fmt: skip
    core = EngineCore(EngineConfig(
        model="dummy:tiny", device="cuda", spec=spec, cuda_graphs=True,
        scheduler=SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=512,
                                  max_model_len=1024),
        cache=CacheConfig(num_blocks=1024),
    ))  # fmt: skip
    driver = SyncDriver(core)
    compiled: list[str] = []
    previous = runtime.jit_cache_hook

    def hook(*, repr: str, compile: dict, **_) -> bool:  # noqa: A002 (Triton's keywords)
        compiled.append(f"{repr.split('[')[0]} {compile.get('constants')}"[:400])
        return False  # compile as usual

    runtime.jit_cache_hook = hook
    try:
        rng = np.random.default_rng(0)
        vocab = core.model_config.vocab_size
        for i in range(40):
            n = int(rng.integers(1, 300))
            params = SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=True,
                                    temperature=float(rng.choice([0.0, 0.8])), seed=i)  # fmt: skip
            core.add_request(f"r{i}", rng.integers(0, vocab, n).tolist(), params)
            for _ in range(int(rng.integers(0, 4))):
                driver.step()
        while core.has_unfinished():
            driver.step()
    finally:
        runtime.jit_cache_hook = previous
    assert compiled == []
