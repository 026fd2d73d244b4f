"""On the GPU: draft steps that advance the q = 1 graph's inputs on the device (``run_next``:
every step after a proposal's first) draft the same tokens as steps prepared on the host,
across block boundaries, catch-ups and rollbacks; and a drafter a few tokens behind (plain
steps between rounds, or a whole prompt) that catches up in catch-up or chunk graphs (their
attention in short pieces or not) drafts what an eager catch-up drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verifypd.engine.core import EngineCore
from verifypd.types import SamplingParams, ScheduledSeq, Sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _drafts(core: EngineCore, prompts, accepted: list[list[int]], use_graph_steps: bool):
    drafter = core.spec.drafter
    if not use_graph_steps:
        drafter._continue_graph = lambda views, prev: None
    seqs = [Sequence(f"s{use_graph_steps}{i}", p, SamplingParams(max_tokens=256, temperature=0))
            for i, p in enumerate(prompts)]  # fmt: skip
    out = []
    for per_seq in accepted:  # one proposal per round; then k drafts and a new token accepted
        entries = [ScheduledSeq(s, 1) for s in seqs]
        drafter.propose(entries, [4] * len(seqs), [0.0] * len(seqs))
        drafts = [e.draft_ids() for e in entries]
        out.append(drafts)
        for s, d, k in zip(seqs, drafts, per_seq, strict=True):
            s.token_ids += d[:k] + [(d[-1] + 1) % 500]
            drafter.verified(s.seq_id, k)
    for s in seqs:
        drafter.free(s.seq_id)
    return out, drafter.runner.num_graph_steps


def test_graph_steps_draft_what_host_prepared_steps_draft():
    spec = SpecConfig(method="draft", draft_model="dummy:tiny", max_draft_len=4,
                      initial_draft_len=4, controller=False)  # fmt: skip
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 500, n).tolist() for n in (5, 30, 64)]
    accepted = [rng.integers(0, 5, len(prompts)).tolist() for _ in range(24)]
    results = []
    for use_graph_steps in (True, False):
        core = EngineCore(EngineConfig(
            model="dummy:tiny", device="cuda", spec=spec, cuda_graphs=True,
            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512),
            cache=CacheConfig(num_blocks=256, block_size=8, enable_prefix_caching=False),
        ))  # fmt: skip
        results.append(_drafts(core, prompts, accepted, use_graph_steps))
    (with_steps, full_runs_with), (without, full_runs_without) = results
    assert with_steps == without
    assert full_runs_with < full_runs_without / 2  # most steps advanced on the device


def test_catch_up_graphs_draft_what_eager_catch_ups_draft():
    rng = np.random.default_rng(5)
    # a 40-token prompt catches up in the 16-token chunk graph, the others in the 64-token one
    prompts = [rng.integers(0, 500, n).tolist() for n in (40, 70, 100, 200)]
    rounds = [(rng.integers(0, 5, 4).tolist(), rng.integers(0, 7, 4).tolist()) for _ in range(20)]
    results = []
    # the 64-token chunk graph's attention in pieces of 32 (G = 2) or on the prefill kernel
    configs = (((4, 8), (16, 64), True), ((4, 8), (16, 64), False), ((), 0, True))
    for catch_up_graphs, chunk, short in configs:
        spec = SpecConfig(method="draft", draft_model="dummy:tiny", max_draft_len=4,
                          initial_draft_len=4, controller=False, chunk_short_attention=short,
                          catch_up_graphs=catch_up_graphs, catch_up_chunk=chunk)  # fmt: skip
        core = EngineCore(EngineConfig(
            model="dummy:tiny", device="cuda", dtype="float32", spec=spec, cuda_graphs=True,
            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512),
            cache=CacheConfig(num_blocks=256, block_size=8, enable_prefix_caching=False),
        ))  # fmt: skip
        drafter = core.spec.drafter
        seqs = [Sequence(f"c{i}", p, SamplingParams(max_tokens=256, temperature=0))
                for i, p in enumerate(prompts)]  # fmt: skip
        drafts_out = []
        for accepted, plain in rounds:  # a verify, then a few plain steps, then a proposal
            entries = [ScheduledSeq(s, 1) for s in seqs]
            drafter.propose(entries, [4] * len(seqs), [0.0] * len(seqs))
            drafts = [e.draft_ids() for e in entries]
            drafts_out.append(drafts)
            for s, d, k, m in zip(seqs, drafts, accepted, plain, strict=True):
                s.token_ids += d[:k] + [(d[-1] + 1 + j) % 500 for j in range(1 + m)]
                drafter.verified(s.seq_id, k)
        results.append((drafts_out, drafter.runner.num_eager_steps))
    (with_graphs, eager_with), (prefill_kernel, _), (without, eager_without) = results
    assert with_graphs == prefill_kernel == without
    assert eager_with == 0  # the prompts in chunk replays, every later catch-up in one replay
    assert eager_without >= 10
