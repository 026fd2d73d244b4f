"""Prompt steps padded to a bucket of rows (``EngineConfig.prompt_token_bucket``, GPU): the pad
rows belong to no sequence, store no KV and change no token; decode steps are never padded."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import tiny_config

from verifypd.engine.core import EngineCore
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.types import SamplingParams, ScheduledSeq, SeqStatus, StepPlan

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _core(bucket: int) -> EngineCore:
    core = EngineCore(tiny_config())
    assert core.runner.inputs.prompt_token_bucket == 0  # CPU: off (no cuBLAS to spare)
    core.runner.inputs.prompt_token_bucket = bucket  # as on a GPU
    return core


def _plan(core: EngineCore, lane: str, rid: str, n: int) -> StepPlan:
    (seq,) = core.add_request(rid, list(range(3, 3 + n)), GREEDY)
    assert core.kv.allocate(seq.block_table, n)
    return StepPlan(lane, [ScheduledSeq(seq, n)])


@pytest.mark.parametrize(("n", "rows"), [(20, 64), (64, 64), (65, 128), (16, 16), (5, 5)])
def test_prompt_steps_are_padded_to_the_bucket(n: int, rows: int) -> None:
    core = _core(64)
    inputs = core.runner.prepare(_plan(core, "prefill", "a", n))
    meta = inputs.meta
    assert inputs.input_ids.shape == inputs.positions.shape == meta.slot_mapping.shape == (rows,)
    assert meta.query_start_loc.tolist() == [0, n] and meta.query_lens_cpu == [n]
    assert (meta.slot_mapping[n:] == -1).all() and (meta.slot_mapping[:n] >= 0).all()
    assert inputs.sample_rows == [n - 1]


def test_mixed_steps_with_a_prompt_chunk_are_padded_and_other_steps_never() -> None:
    """A mixed step carrying a prompt chunk (the single lane; decode rows inside a prompt step
    in a backlog, ``lanes.backlog_fuse``) is padded like a prompt step; one of decode rows
    only, and drafting, never."""
    core = _core(64)
    plan = _plan(core, "mixed", "a", 20)
    plan.seqs[0].seq.status = SeqStatus.PREFILLING  # admitted: its prompt chunk
    assert core.runner.prepare(plan).input_ids.shape == (64,)
    assert core.runner.prepare(_plan(core, "draft", "b", 20)).input_ids.shape == (20,)
    plan = _plan(core, "mixed", "c", 20)
    plan.seqs[0].seq.status = SeqStatus.DECODING  # as a decode row's: no prompt chunk
    assert core.runner.prepare(plan).input_ids.shape == (20,)


def test_padding_changes_no_token_and_no_kv() -> None:
    """Same greedy tokens with and without padding, and the same KV in every slot (the pad
    rows wrote none)."""
    outs, pools = [], []
    for bucket in (0, 64):
        core = _core(bucket)
        got: list = []

        async def launch(lane, plan, core=core):
            return core.launch(plan)

        d = LaneDispatcher(core, launch, got.append, 0.5)
        core.add_request("a", list(range(3, 40)), GREEDY)
        core.add_request("b", list(range(7, 30)), GREEDY)

        async def run(d=d, core=core):
            for _ in range(200):
                await d.tick()
                if not core.has_unfinished():
                    return

        asyncio.run(run())
        tokens: dict[str, list[int]] = {}
        for o in got:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(tokens)
        pools.append(core.runner.pool.kv.clone())
        assert core.kv.num_free_blocks == core.kv.num_blocks
    assert outs[0] == outs[1] and len(outs[0]["a"]) == 8
    torch.testing.assert_close(pools[0], pools[1], rtol=0, atol=1e-6)


def test_prompt_token_bucket_is_validated() -> None:
    assert tiny_config().prompt_token_bucket == 64
    with pytest.raises(ValueError, match="prompt_token_bucket"):
        tiny_config(prompt_token_bucket=-64)
