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


def test_decode_rows_then_prompt_chunks_get_their_attention_split() -> None:
    """A mixed step of one-token decode rows, then prompt chunks (decode rows inside a prompt
    step, ``lanes.backlog_fuse``) carries ``meta.split``: the rows for the split-K kernel, the
    chunks (counted in the whole step's rows) for the prefill kernel. A prompt step, a decode
    step, and a mixed step whose rows do not come first, or carry drafts, carry none."""
    core = _core(0)
    rows = []
    for rid, n in (("d0", 5), ("d1", 9)):
        (seq,) = core.add_request(rid, list(range(3, 3 + n)), GREEDY)
        assert core.kv.allocate(seq.block_table, n + 1)
        seq.num_computed_tokens, seq.status = n, SeqStatus.DECODING
        seq.token_ids.append(7)  # its first output token, the next query
        rows.append(ScheduledSeq(seq, 1))
    chunks = []
    for rid, n in (("p0", 12), ("p1", 7)):
        plan = _plan(core, "prefill", rid, n)
        plan.seqs[0].seq.status = SeqStatus.PREFILLING
        chunks += plan.seqs
    meta = core.runner.prepare(StepPlan("mixed", rows + chunks)).meta
    split = meta.split
    assert split is not None and split.num_decode_rows == 2
    assert split.decode.query_start_loc.tolist() == [0, 1, 2]
    assert split.decode.seq_lens.tolist() == [6, 10] and split.decode.max_seq_len == 10
    assert split.prompt.query_start_loc.tolist() == [2, 14, 21]
    assert split.prompt.seq_lens.tolist() == [12, 7] and split.prompt.num_seqs == 2
    assert core.runner.prepare(StepPlan("mixed", chunks + rows)).meta.split is None
    assert core.runner.prepare(StepPlan("mixed", rows)).meta.split is None
    assert core.runner.prepare(StepPlan("prefill", chunks)).meta.split is None
    rows[0].draft_token_ids = [4, 5]  # a verify row: not one token
    assert core.runner.prepare(StepPlan("mixed", rows + chunks)).meta.split is None
