"""Step inputs: every device view the kernels get starts 16-byte aligned, whatever the step's
token and sequence counts (Triton specializes pointer arguments on that alignment, so a count-
dependent offset would compile a second kernel variant mid-run)."""

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
