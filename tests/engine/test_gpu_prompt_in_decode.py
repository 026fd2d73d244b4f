"""On the GPU: short prompts computed inside decode steps replayed in the captured
prompt-in-decode graphs (``EngineConfig.prompt_in_decode_tokens``) give the tokens and the KV
that prompt steps give (the CPU tests check the layout and the dispatcher's rules)."""

from __future__ import annotations

import pytest
import torch
from helpers import serve_arrivals

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _serve(sizes: tuple[int, ...], dtype: str):
    core = EngineCore(EngineConfig(
        model="dummy:tiny", device="cuda", dtype=dtype, cuda_graphs=True,
        prompt_in_decode_tokens=sizes,
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
        cache=CacheConfig(num_blocks=256, block_size=16),
    ))  # fmt: skip
    graphs = core.runner.inputs.prompt_in_decode
    assert [g.q for g in graphs] == list(sizes) and all(g.graphs for g in graphs)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    prompts = [
        ("first", list(range(3, 40)), greedy),  # alone: a prompt step
        ("short", list(range(3, 12)), greedy),
        ("full", list(range(5, 5 + 64)), greedy),
        ("sampled", list(range(9, 49)), sampled),
        ("long", list(range(7, 7 + 300)), greedy),  # longer than every graph
        ("after", list(range(11, 31)), greedy),
    ]
    got: dict[str, list[int]] = {}
    inside: list[str] = []

    async def launch(lane, plan):
        if plan.carries_prompt:
            inside.append(plan.seqs[-1].seq.request_id)
        return core.launch(plan)

    d = LaneDispatcher(core, launch, lambda o: got.setdefault(o.request_id, []).extend(
        o.new_token_ids), 60.0, prompt_in_decode_tokens=max(sizes, default=0))  # fmt: skip

    serve_arrivals(core, d, prompts, 2000)
    assert not core.has_unfinished()
    torch.cuda.synchronize()
    core.check_integrity()
    replays = sum(len(g.replays) for g in graphs)
    return got, inside, replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_in_decode_replays_give_the_prompt_steps_tokens_and_kv(dtype):
    want, plain_inside, _ = _serve((), dtype)
    got, inside, replays = _serve((16, 64), dtype)
    # Which prompts ride depends on which steps are in flight when they arrive (the GPU's
    # timing); the first (no decode row yet) and the long one (no graph holds it) never do.
    assert plain_inside == [] and "short" in inside and not {"first", "long"} & set(inside)
    assert replays == len(inside)
    # (The pools are not compared: riding changes the order of admissions, so which blocks
    # each sequence holds; every token after the first reads the prompt's KV.)
    if dtype == "float32":
        assert got == want and all(len(t) == 12 for t in got.values())
    else:  # bf16: other GEMM shapes round differently; a near tie may flip, most tokens agree
        same = sum(a == b for r in want for a, b in zip(got[r], want[r], strict=True))
        assert same >= 0.9 * sum(len(t) for t in want.values())
