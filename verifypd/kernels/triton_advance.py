"""Advance a decode step's inputs on the device by one token (Triton), for the drafter's
graph steps after a proposal's first (``StepGraphs.run_next``).

Per row: the next input id from the last step's pick, position + 1, context length + 1, and the
new position's KV slot from the block table. One launch instead of the ten small torch ops this
takes otherwise; at batch 1 the drafter's rounds are bound by the GPU's small kernels.
``advance_reference`` is the same in torch (CPU tests, and the semantics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS_PER_PROGRAM = 256


@triton.jit(do_not_specialize=["num_rows"])
def _advance_kernel(
    next_ids_ptr,  # [B] int64: each row's pick of the last step
    input_ids_ptr,  # [>= B] int64
    positions_ptr,  # [>= B] int64
    seq_lens_ptr,  # [>= B] int32
    block_tables_ptr,  # [>= B, W] int32
    slots_ptr,  # [>= B] int64
    num_rows,
    stride_table,
    BLOCK_SIZE: tl.constexpr,  # the KV cache's block size
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = rows < num_rows
    pos = tl.load(positions_ptr + rows, mask=mask, other=0) + 1
    tl.store(positions_ptr + rows, pos, mask=mask)
    tl.store(seq_lens_ptr + rows, tl.load(seq_lens_ptr + rows, mask=mask, other=0) + 1, mask=mask)
    block = tl.load(
        block_tables_ptr + rows.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=mask, other=0
    )
    tl.store(slots_ptr + rows, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)
    tl.store(input_ids_ptr + rows, tl.load(next_ids_ptr + rows, mask=mask, other=0), mask=mask)


def advance(
    next_ids: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    """Advances the first ``len(next_ids)`` rows of the step buffers in place."""
    b = next_ids.shape[0]
    assert block_tables.stride(1) == 1, "block_tables: rows must be contiguous"
    rows = min(MAX_ROWS_PER_PROGRAM, triton.next_power_of_2(max(b, 1)))
    _advance_kernel[(triton.cdiv(b, rows),)](
        next_ids, input_ids, positions, seq_lens, block_tables, slots, b,
        block_tables.stride(0), BLOCK_SIZE=block_size, ROWS=rows,
    )  # fmt: skip


def advance_reference(
    next_ids: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    b = next_ids.shape[0]
    input_ids[:b].copy_(next_ids)
    pos = positions[:b]
    pos += 1
    seq_lens[:b] += 1
    blocks = block_tables[:b].gather(1, (pos // block_size)[:, None]).squeeze(1)
    slots[:b] = blocks.to(torch.int64) * block_size + pos % block_size
