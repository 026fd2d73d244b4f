"""On the GPU: the drafter follows prompt steps after their launch, in pieces on the follow
stream, while decode and verify steps run on theirs (``SpecConfig.follow_prefill`` with the
goodput policy and ``prefill_slice_layers``), or catches up there behind plain decode steps
(``SpecConfig.follow_decode_max_rows``).

``dummy:tiny`` drafts for itself in fp32: with its KV of a prompt computed right, every draft
matches the target's token, so acceptance stays near 1; a draft read before the drafter's
forward behind the prompt has run (or KV written to blocks that went back) shows as rejected
drafts. The tokens are the plain engine's (greedy, fp32), and nothing leaks. Also a script:
``python tests/lanes/test_gpu_follow_prefill.py``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="prompt steps are enqueued in pieces only on a GPU"
)


def _config(
    follow: bool | None, decode_rows: int = 0, window: int | None = None, beside: str = "decode"
) -> EngineConfig:
    """``follow`` None: no speculation; else the goodput policy, the drafter following prompt
    steps or not, and decode steps at up to ``decode_rows`` rows (on the stream ``beside``
    names, ``SpecConfig.follow_decode_stream``; with the drafter's context ``window``)."""
    spec = SpecConfig() if follow is None else SpecConfig(
        method="draft", draft_model="dummy:tiny", max_draft_len=4, initial_draft_len=4,
        policy="goodput", follow_prefill=follow, follow_decode_max_rows=decode_rows,
        draft_window=window, follow_decode_stream=beside,
    )  # fmt: skip
    return EngineConfig(
        model="dummy:tiny", device="cuda", dtype="float32", spec=spec, prefill_slice_layers=1,
        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=1024, max_prefill_chunk=96,
                                  max_num_batched_tokens=96),
        cache=CacheConfig(num_blocks=1024, enable_prefix_caching=False),
    )  # fmt: skip


async def _run(
    follow: bool | None, decode_rows: int = 0, window: int | None = None, beside: str = "decode"
) -> tuple[list[list[int]], AsyncEngine]:
    from helpers import generate_all, pin_costs  # tests/ (on the path under pytest, or by __main__)

    engine = AsyncEngine(_config(follow, decode_rows, window, beside))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, int(rng.integers(8, 300))).tolist() for _ in range(16)]
    fed: list[int] = []
    drafter = engine.core.spec.drafter
    if drafter is not None:
        # The drafter is the target itself: on its calibrated costs a round never pays and the
        # policy speculates for nobody. On a memory-bound shape (drafter steps cheap) it does.
        pin_costs(engine.core.costs)
        inner = drafter.follow_iter

        def follow_iter(items, *args):
            fed.append((yield from inner(items, *args)))

        drafter.follow_iter = follow_iter

    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)
    # arrivals spread: prompt steps beside running rounds
    out = await generate_all(engine, prompts, params, timeout=300,
                             delays=[0.01 * i for i in range(16)])  # fmt: skip
    engine.fed = sum(fed)  # type: ignore[attr-defined]
    return out, engine


@pytest.mark.parametrize("kind", ["prefill", "decode", "beside", "below"])
def test_the_drafter_following_steps_on_the_gpu_drafts_from_the_right_kv(kind):
    """``beside`` / ``below``: the feed behind decode steps on a stream of its own, not waited
    for by the step; whatever drafts for a fed view waits for it on the GPU."""
    plain, _ = asyncio.run(_run(None))
    rows = 0 if kind == "prefill" else 16
    stream = kind if kind in ("beside", "below") else "decode"
    followed, engine = asyncio.run(_run(kind == "prefill", rows, beside=stream))
    spec = engine.core.spec
    assert engine.fed > 0 and spec.num_verifies > 0  # followed, and speculated
    follower = spec.drafter.follower
    assert follower.num_follow_replays > 0  # in chunk graphs: the follow stream's own for
    assert bool(follower.follow_graphs) == (kind == "prefill")  # prompts, the proposer's else
    assert bool(follower.feed_graphs) == (stream != "decode")  # (the feed stream's own beside)
    acceptance = spec.num_accepted / max(spec.num_drafted, 1)
    assert acceptance > 0.9, f"drafts from a wrong drafter KV: acceptance {acceptance:.3f}"
    diverged = [i for i, (a, b) in enumerate(zip(plain, followed, strict=True)) if a != b]
    assert not diverged, f"requests {diverged} differ from plain greedy decoding"


def test_a_windowed_drafter_on_the_gpu_is_lossless_and_feeds_only_windows():
    """``SpecConfig.draft_window`` = 32 (sink 4): the follow behind prompt steps, the chunk
    and chain graphs all run on views whose positions are their own. The drafter is the
    target, but it no longer sees whole prompts, so acceptance is not asserted."""
    plain, _ = asyncio.run(_run(None))
    windowed, engine = asyncio.run(_run(True, window=32))
    spec = engine.core.spec
    assert engine.fed > 0 and spec.num_verifies > 0
    assert engine.fed <= 16 * (32 + 4) + 16 * 48  # windows (and decoded tokens), not prompts
    diverged = [i for i, (a, b) in enumerate(zip(plain, windowed, strict=True)) if a != b]
    assert not diverged, f"requests {diverged} differ from plain greedy decoding"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    for kind in ("prefill", "decode", "beside", "below"):
        test_the_drafter_following_steps_on_the_gpu_drafts_from_the_right_kv(kind)
    test_a_windowed_drafter_on_the_gpu_is_lossless_and_feeds_only_windows()
    print("ok")
