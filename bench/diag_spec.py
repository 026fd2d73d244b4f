"""Diagnostic: where a speculative run spends its steps (graph vs eager, per-lane step times).

python bench/diag_spec.py --lane-mode single --batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from verifypd.lanes.async_engine import AsyncEngine  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402


async def run(args) -> None:
    spec = SpecConfig(method="draft", draft_model=args.draft, max_draft_len=4,
                      initial_draft_len=4, controller=False, synthetic_acceptance=0.8)  # fmt: skip
    cfg = EngineConfig(
        model=args.model, lane_mode=args.lane_mode, spec=spec if args.spec else SpecConfig(),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_model_len=4096),
        cache=CacheConfig(num_blocks=args.batch * 40 + 64, enable_prefix_caching=False),
    )  # fmt: skip
    engine = AsyncEngine(cfg)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i):
        ids = rng.integers(0, engine.core.model_config.vocab_size, args.prompt_len).tolist()
        n = 0
        async for out in engine.generate(f"r{i}-{time.time()}", ids, params):
            n += len(out.new_token_ids)
        return n

    for rep in range(2):
        runner, core = engine.core.runner, engine.core
        runner.num_graph_steps = runner.num_eager_steps = 0
        runner.eager_shapes.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(one(i) for i in range(args.batch))))
        dt = time.perf_counter() - t0
        eager = dict(runner.eager_shapes)
        print(f"rep {rep}: {n} tokens in {dt:.3f}s = {n / dt:.1f} tok/s; target graph steps "
              f"{runner.num_graph_steps}, eager {runner.num_eager_steps} {eager}")  # fmt: skip
        d = core.spec.drafter
        if d is not None:
            print(
                f"   drafter graph {d.runner.num_graph_steps} eager {d.runner.num_eager_steps} "
                f"{dict(d.runner.eager_shapes)}; spec drafted {core.spec.num_drafted} "
                f"accepted {core.spec.num_accepted} verifies {core.spec.num_verifies}"
            )
    await engine.stop()


def check_drafter(args) -> None:
    """Drafts with the device-advanced graph steps equal drafts prepared on the host."""
    from verifypd.engine.core import EngineCore
    from verifypd.types import ScheduledSeq, Sequence

    spec = SpecConfig(method="draft", draft_model=args.draft, max_draft_len=8, initial_draft_len=8)
    cfg = EngineConfig(model=args.draft, spec=spec,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=4096))  # fmt: skip
    core = EngineCore(cfg)
    drafter = core.spec.drafter
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 150000, n).tolist() for n in (37, 64, 100, 5)]
    results = []
    for advance in (True, False):
        if not advance:
            drafter._continue_graph = lambda views, prev: None
        seqs = [Sequence(f"c{i}{advance}", p, SamplingParams(max_tokens=64, temperature=0))
                for i, p in enumerate(prompts)]  # fmt: skip
        drafts = []
        for _ in range(3):  # three rounds: catch-up, then rounds over a grown prefix
            entries = [ScheduledSeq(s, 1) for s in seqs]
            drafter.propose(entries, [8] * len(seqs), [0.0] * len(seqs))
            drafts.append([e.draft_ids() for e in entries])
            for s, e in zip(seqs, entries, strict=True):
                s.token_ids += e.draft_ids()[:3]  # pretend three were accepted
        for s in seqs:
            drafter.free(s.seq_id)
        results.append(drafts)
    print("drafter device-advanced == host-prepared:", results[0] == results[1],
          "graph steps", drafter.runner.num_graph_steps)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--draft", default="dummy:qwen2.5-0.5b")
    p.add_argument("--lane-mode", default="single")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--spec", type=int, default=1)
    p.add_argument("--check-drafter", action="store_true")
    args = p.parse_args()
    if args.check_drafter:
        check_drafter(args)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
