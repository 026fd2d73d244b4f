"""Step inputs: every device view the kernels get starts 16-byte aligned, whatever the step's
token and sequence counts (Triton specializes pointer arguments on that alignment, so a count-
dependent offset would compile a second kernel variant mid-run); every row's position and KV
slot are its block table's, in short steps (a Python loop) and long ones (array operations)."""

from __future__ import annotations

import pytest
from helpers import tiny_config

from verifypd.engine.core import EngineCore
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(tiny_config())


def _offset(t) -> int:
    return t.data_ptr() - t.untyped_storage().data_ptr()


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("prompt_len", [1, 2, 7, 16, 33])
def test_every_input_view_is_16_byte_aligned(core, num_seqs, prompt_len):
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", list(range(1, prompt_len + i + 1)), SamplingParams(max_tokens=4))
        assert core.kv.allocate(seq.block_table, seq.num_tokens)
        seqs.append(seq)
    try:
        plan = StepPlan("prefill", [ScheduledSeq(s, s.num_tokens) for s in seqs])
        inputs = core.runner.prepare(plan)
        meta = inputs.meta
        views = [inputs.input_ids, inputs.positions, meta.slot_mapping, meta.query_start_loc,
                 meta.seq_lens, meta.block_tables]  # fmt: skip
        assert all(_offset(v) % 16 == 0 for v in views), [_offset(v) for v in views]
        lens = [prompt_len + i for i in range(num_seqs)]
        assert inputs.positions.tolist() == [p for n in lens for p in range(n)]
        assert meta.seq_lens.tolist() == lens
        assert meta.query_start_loc.tolist() == [sum(lens[:i]) for i in range(num_seqs + 1)]
        assert [row[: len(s.block_table)] for row, s in zip(meta.block_tables.tolist(), seqs,
                strict=True)] == [s.block_table for s in seqs]  # fmt: skip
        assert meta.slot_mapping.shape == inputs.input_ids.shape == (sum(lens),)
    finally:
        for s in seqs:
            core.kv.free(s.block_table)


def _seq(core, name: str, prompt_len: int, computed: int, extra_blocks: int = 1) -> Sequence:
    seq = Sequence(name, [(7 * k + len(name)) % 97 + 1 for k in range(prompt_len)],
                   SamplingParams(max_tokens=8))  # fmt: skip
    assert core.kv.allocate(seq.block_table, prompt_len + extra_blocks * core.kv.block_size)
    seq.num_computed_tokens = computed
    return seq


def _reference(builder, plan: StepPlan, pad_to: int, pad: int):
    """Each row's id, position and slot, token by token from the block tables; ``pad`` rows of
    id 0, position 0 and slot -1 after them."""
    bs = builder.block_size
    ids, pos, slots = [], [], []
    for s in plan.seqs:
        start, toks = builder._query_tokens(s, pad_to)
        ids += toks
        pos += range(start, start + len(toks))
        slots += [s.seq.block_table[p // bs] * bs + p % bs for p in range(start, start + len(toks))]
    return ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad


@pytest.mark.parametrize("scale", [1, 4])  # a step of <= LOOPED_ROWS (32) rows, one past it
def test_positions_and_slots_match_the_block_tables_row_by_row(core, scale):
    """Prompt chunks (from the start and from a computed prefix), padded to the prompt bucket;
    and decode rows beside verifies of several L, padded to the longest: each row's id,
    position and KV slot are the ones the sequence's block table gives token by token."""
    builder = core.runner.inputs
    saved = builder.prompt_token_bucket, builder.always_pad_verify
    seqs: list[Sequence] = []
    try:
        builder.prompt_token_bucket, builder.always_pad_verify = 64, True
        chunks = [(_seq(core, "a", 12 * scale, 0), 12 * scale), (_seq(core, "bb", 44 * scale, 37),
                  4 * scale), (_seq(core, "c", 1, 0), 1)]  # fmt: skip
        rows = [(_seq(core, f"d{i}", 20 + 17 * i, 19 + 17 * i), [3] * (i % 4)) for i in
                range(4 * scale)]  # fmt: skip
        seqs = [s for s, _ in chunks + rows]
        for lane, entries in (("prefill", [ScheduledSeq(s, n) for s, n in chunks]),
                              ("decode", [ScheduledSeq(s, 1, d) for s, d in rows])):  # fmt: skip
            plan = StepPlan(lane, entries)
            pad_to = builder.verify_width(plan)
            real = sum(len(builder._query_tokens(s, pad_to)[1]) for s in plan.seqs)
            pad = builder._prompt_padding(real) if lane == "prefill" else 0
            assert (pad > 0) == (lane == "prefill") and (pad_to == 3) == (lane == "decode")
            ids, pos, slots = _reference(builder, plan, pad_to, pad)
            inputs = core.runner.prepare(plan)
            assert inputs.input_ids.tolist() == ids
            assert inputs.positions.tolist() == pos
            assert inputs.meta.slot_mapping.tolist() == slots
    finally:
        builder.prompt_token_bucket, builder.always_pad_verify = saved
        for s in seqs:
            core.kv.free(s.block_table)
