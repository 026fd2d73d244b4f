"""On the GPU: short prompt steps replayed in the captured prompt graph
(``EngineConfig.prompt_graph_tokens``) give the tokens and the KV that eager prompt steps give,
for one prompt and two in a step, a prompt after a prefix hit, and with a long prompt's eager
chunks around them (the CPU tests check the padding with an eager stand-in)."""

from __future__ import annotations

import pytest
import torch
from helpers import serve_arrivals

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

Q = 64


def _serve(q: int):
    core = EngineCore(EngineConfig(
        model="dummy:tiny", device="cuda", dtype="float32", cuda_graphs=True,
        prompt_graph_tokens=q,
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
        cache=CacheConfig(num_blocks=256, block_size=16),
    ))  # fmt: skip
    assert (Q in core.runner.graphs) == bool(q)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    shared = list(range(100, 132))
    prompts = [
        ("short", list(range(3, 12)), greedy),
        ("full", list(range(5, 5 + Q)), greedy),
        ("sampled", list(range(9, 49)), sampled),
        ("long", list(range(7, 7 + 3 * Q)), greedy),
        ("prefix", [*shared, 1, 2, 3], greedy),
        ("prefix-hit", [*shared, 4, 5, 6, 7], greedy),
    ]
    got: dict[str, list[int]] = {}

    async def launch(lane, plan):
        return core.launch(plan)

    d = LaneDispatcher(core, launch, lambda o: got.setdefault(o.request_id, []).extend(
        o.new_token_ids), 0.0)  # fmt: skip

    before = core.runner.num_graph_steps
    serve_arrivals(core, d, prompts, 2000)
    assert not core.has_unfinished()
    torch.cuda.synchronize()
    core.check_integrity()
    return got, core.runner.pool.kv.clone(), core.runner.num_graph_steps - before


def test_prompt_graph_replays_give_the_eager_tokens_and_kv():
    want, want_kv, plain_graph_steps = _serve(0)
    got, got_kv, graph_steps = _serve(Q)
    assert got == want and all(len(t) == 12 for t in got.values())
    assert graph_steps >= plain_graph_steps + 3  # short; full + sampled; the prefix hit
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=1e-4)
