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

# Rows per program, one value for every batch: a constexpr that followed the batch would
# compile a variant per batch size, under traffic.
ROWS_PER_PROGRAM = 256


@triton.jit(do_not_specialize=["next_ids_ptr", "num_rows", "stride_table"])
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
    _advance_kernel[(triton.cdiv(b, ROWS_PER_PROGRAM),)](
        next_ids, input_ids, positions, seq_lens, block_tables, slots, b,
        block_tables.stride(0), BLOCK_SIZE=block_size, ROWS=ROWS_PER_PROGRAM,
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


# Everything that is not a graph buffer may change alignment or value from call to call.
@triton.jit(
    do_not_specialize=[
        "rows_ptr", "num_accepted_ptr", "verify_ids_ptr", "out_ptr", "block_tables_ptr",
        "num_rows", "num_padded", "stride_out", "stride_table", "vocab_size",
    ]
)  # fmt: skip
def _chain_inputs_kernel(
    rows_ptr,  # [3, B] int64: verify row, first input row, position of the last known token
    num_accepted_ptr,  # [Bv] int64
    verify_ids_ptr,  # [T] int64: the verify's input ids
    out_ptr,  # [Bv, 1 + L] int64: accepted drafts, then the final token
    block_tables_ptr,  # [B, W] int32
    input_ids_ptr,  # [>= 2 * padded] int64: the 2-token step's buffers
    positions_ptr,
    slots_ptr,
    seq_lens_ptr,  # [>= padded] int32
    next_positions_ptr,  # [>= B] int64: the 1-token steps' buffers, seeded
    next_seq_lens_ptr,  # [>= B] int32
    num_rows,
    num_padded,
    stride_out,
    stride_table,
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    real = r < num_rows
    pad = (r >= num_rows) & (r < num_padded)
    vrow = tl.load(rows_ptr + r, mask=real, other=0)
    first = tl.load(rows_ptr + num_rows + r, mask=real, other=0)
    base = tl.load(rows_ptr + 2 * num_rows + r, mask=real, other=0)
    k = tl.load(num_accepted_ptr + vrow, mask=real, other=0)
    x = tl.load(verify_ids_ptr + first + k, mask=real, other=0)
    final = tl.load(out_ptr + vrow * stride_out + k, mask=real, other=0)
    x = tl.where(x < vocab_size, x, 0)
    final = tl.where(final < vocab_size, final, 0)
    pos = base + k
    table = block_tables_ptr + r.to(tl.int64) * stride_table
    slot0 = tl.load(table + pos // BLOCK_SIZE, mask=real, other=0).to(tl.int64) * BLOCK_SIZE
    slot1 = tl.load(table + (pos + 1) // BLOCK_SIZE, mask=real, other=0).to(tl.int64) * BLOCK_SIZE
    slot0 = tl.where(real, slot0 + pos % BLOCK_SIZE, -1)
    slot1 = tl.where(real, slot1 + (pos + 1) % BLOCK_SIZE, -1)
    live = real | pad
    tl.store(input_ids_ptr + 2 * r, x, mask=real)
    tl.store(input_ids_ptr + 2 * r + 1, final, mask=real)
    tl.store(positions_ptr + 2 * r, pos, mask=real)
    tl.store(positions_ptr + 2 * r + 1, pos + 1, mask=real)
    tl.store(slots_ptr + 2 * r, slot0, mask=live)
    tl.store(slots_ptr + 2 * r + 1, slot1, mask=live)
    tl.store(seq_lens_ptr + r, tl.where(real, pos + 2, 2).to(tl.int32), mask=live)
    tl.store(next_positions_ptr + r, pos + 1, mask=real)
    tl.store(next_seq_lens_ptr + r, (pos + 2).to(tl.int32), mask=real)


def chain_inputs(
    rows: torch.Tensor,
    num_accepted: torch.Tensor,
    verify_ids: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    step: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    next_step: tuple[torch.Tensor, torch.Tensor],
    num_padded: int,
    vocab_size: int,
    block_size: int,
) -> None:
    """The inputs of a chained proposal's 2-token step after a verify, written straight into
    its graph's buffers ``step`` = (input ids, positions, slots, context lengths), and the
    1-token steps' seeds ``next_step`` = (positions, context lengths). Row r feeds the token
    before the verify's final one and the final one: with k = ``num_accepted[rows[0, r]]``,
    ids ``verify_ids[rows[1, r] + k]`` and ``out[rows[0, r], k]`` (ids past the drafter's
    vocabulary map to 0) at positions ``rows[2, r] + k`` and one more. Rows from B to
    ``num_padded`` are graph padding: no KV slot, a context of 2."""
    b = rows.shape[1]
    assert rows.is_contiguous() and out.stride(1) == 1 and block_tables.stride(1) == 1
    _chain_inputs_kernel[(triton.cdiv(num_padded, ROWS_PER_PROGRAM),)](
        rows, num_accepted, verify_ids, out, block_tables, *step, *next_step, b, num_padded,
        out.stride(0), block_tables.stride(0), vocab_size, BLOCK_SIZE=block_size,
        ROWS=ROWS_PER_PROGRAM,
    )  # fmt: skip


def chain_inputs_reference(
    rows, num_accepted, verify_ids, out, block_tables, step, next_step, num_padded, vocab_size,
    block_size,
) -> None:  # fmt: skip
    ids, positions, slots, seq_lens = step
    b = rows.shape[1]
    k = num_accepted[rows[0]]
    pair = torch.stack([verify_ids[rows[1] + k], out[rows[0]].gather(1, k[:, None])[:, 0]], 1)
    pos = (rows[2] + k)[:, None] + torch.arange(2, device=rows.device)
    ids[: 2 * b] = torch.where(pair < vocab_size, pair, 0).flatten()
    positions[: 2 * b] = pos.flatten()
    blocks = block_tables.gather(1, pos // block_size).to(torch.int64)
    slots[: 2 * b] = (blocks * block_size + pos % block_size).flatten()
    slots[2 * b : 2 * num_padded] = -1
    seq_lens[:b] = (pos[:, 1] + 1).to(torch.int32)
    seq_lens[b:num_padded] = 2
    next_step[0][:b] = pos[:, 1]
    next_step[1][:b] = (pos[:, 1] + 1).to(torch.int32)
