"""Paged attention for short queries (decode, speculative verify), flash-decoding style (Triton).

Each sequence feeds a few new tokens (1 for decode, 1 + L for a verify pass; at most
``MAX_ROWS`` (token, head) rows per KV head group). Work is split over the context, not the
queries, so that a small batch still fills the GPU.

Stage 1, grid (B, Hkv, S): program (b, h, s) takes the s-th of S equal chunks of sequence b's
context. Its BLOCK_M rows are (query token, query head) pairs: all q_len tokens times the
G = Hq / Hkv query heads of KV head h, so every K/V byte is read once per group. It writes the
softmax-normalised partial output of each row and the row's log-sum-exp. Each sequence's
context is cut into S chunks of its own length (rounded up to whole key tiles), so in a mixed
batch every program of a sequence gets the same amount of work. Causal masking is per row: a
chunk may hold no key visible to an early query token, which then gets weight 0 in stage 2.

Stage 2, grid (T, Hq): merges the S partials of a (token, head) with their log-sum-exps.
With S == 1 stage 1 writes the output directly and stage 2 is skipped.

Two kernels live here because they are the two halves of one operation; neither is used alone.
S is a host-side choice from tensor shapes and ``meta.max_seq_len`` only (no device syncs), so
the launch is CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from verifypd.kernels.attention_tiles import (
    LOG2E,
    attend_range,
    check_attention_inputs,
    dot_precision,
)
from verifypd.kernels.pdl import launch_options, wait_for_previous

if TYPE_CHECKING:
    from verifypd.kernels.metadata import AttentionMetadata

MIN_TOKENS_PER_SPLIT = 64  # one key tile
MAX_SPLITS = 32  # a power of two: the merge kernel pads every split count to it
MAX_ROWS = 64  # (query token, head) rows per program: max_query_len * G must fit


# Ints that change from step to step are not specialized (Triton would compile a variant
# for 1 / multiples of 16): a batch shape first seen under traffic must not compile mid-run.
# The partial buffers' strides scale with the split count, which follows the batch.
_PARTIAL_STRIDES = ["stride_po_t", "stride_po_h", "stride_po_s", "stride_pl_t", "stride_pl_h"]


@triton.jit(do_not_specialize=["stride_bt_b", "num_splits", *_PARTIAL_STRIDES])
def _split_kv_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    part_out_ptr,  # [T, Hq, S, D] fp32, or out [T, Hq, D] when DIRECT_OUT
    part_lse_ptr,  # [T, Hq, S] fp32 (log2 domain); unused when DIRECT_OUT
    qk_scale,  # softmax scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_b,
    stride_po_t,
    stride_po_h,
    stride_po_s,  # unused when DIRECT_OUT
    stride_pl_t,
    stride_pl_h,
    num_splits,  # S
    GROUP_SIZE: tl.constexpr,  # G = Hq / Hkv
    BLOCK_M: tl.constexpr,  # >= max_query_len * G and >= 16 (tl.dot needs 16 rows)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block (page) size
    BLOCK_N: tl.constexpr,  # keys per tile, a multiple of BLOCK_SIZE
    DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    # A padding sequence (no query token, e.g. in a CUDA-graph batch) reads and writes nothing.
    seq_len = tl.where(q_len > 0, tl.load(seq_lens_ptr + b), 0)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = offs_m // GROUP_SIZE  # [BLOCK_M] query token within the sequence
    heads = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M]
    rows = (q_start + tok).to(tl.int64)  # [BLOCK_M] rows of q / out
    q_pos = seq_len - q_len + tok  # [BLOCK_M] absolute position of each row's token
    row_mask = (tok[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, D]
    q_ptrs = q_ptr + rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + b * stride_bt_b
    # Keys up to the first query token's position are visible to every row: whole tiles of
    # them (for decode, all but the chunk's last partial tile) go unmasked.
    num_full = tl.maximum(tl.minimum(end, seq_len - q_len + 1) - start, 0) // BLOCK_N
    full_end = start + num_full * BLOCK_N
    acc, m_i, l_i = attend_range(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start, full_end, end, q_pos,
        kv_head, qk_scale, stride_kc_b, stride_kc_s, stride_kc_h,
        stride_vc_b, stride_vc_s, stride_vc_h, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip

    has_keys = l_i > 0.0  # false for an empty split or a row that sees none of its keys
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    row_off = rows * stride_po_t + heads * stride_po_h  # [BLOCK_M]
    if DIRECT_OUT:
        out_ptrs = part_out_ptr + row_off[:, None] + offs_d[None, :]
        tl.store(out_ptrs, out.to(part_out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part_ptrs = part_out_ptr + (row_off + split * stride_po_s)[:, None] + offs_d[None, :]
        tl.store(part_ptrs, out, mask=row_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        lse_ptrs = part_lse_ptr + rows * stride_pl_t + heads * stride_pl_h + split
        tl.store(lse_ptrs, lse, mask=tok < q_len)


# Ints that change from step to step are not specialized (Triton would compile a variant
# for 1 / multiples of 16): a batch shape first seen under traffic must not compile mid-run.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", *_PARTIAL_STRIDES])
def _merge_splits_kernel(
    part_out_ptr,  # [T, Hq, S, D] fp32
    part_lse_ptr,  # [T, Hq, S] fp32 (log2 domain)
    query_start_loc_ptr,  # [B + 1] int32
    out_ptr,  # [T, Hq, D]
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    num_seqs,  # B
    num_splits,  # S
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # MAX_SPLITS: one variant for every split count (masked)
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Token rows past the last sequence's queries are padding: nothing to merge or write.
    num_cols = tl.where(t < tl.load(query_start_loc_ptr + num_seqs), HEAD_DIM, 0)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse_ptrs = part_lse_ptr + t * stride_pl_t + head * stride_pl_h + offs_s
    lse = tl.load(lse_ptrs, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
    lse_max = tl.max(lse, axis=0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - lse_max), 0.0)  # empty split: 0
    part_ptrs = part_out_ptr + t * stride_po_t + head * stride_po_h
    part_ptrs += offs_s[:, None] * stride_po_s + offs_d[None, :]
    part_mask = s_mask[:, None] & (offs_d[None, :] < num_cols)
    parts = tl.load(part_ptrs, mask=part_mask, other=0.0)  # [SPLITS_PAD, D]
    weight_sum = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(weight_sum > 0.0, weight_sum, 1.0)
    out_ptrs = out_ptr + t * stride_o_t + head * stride_o_h + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < num_cols)


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of the split kernel; BLOCK_N is raised to the cache block size if smaller."""

    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


def is_short_query(max_query_len: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether a batch fits this kernel: all query rows of a KV head group in one tile."""
    return max_query_len * (num_q_heads // num_kv_heads) <= MAX_ROWS


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    tiles: DecodeTiles | None = None,
    out: torch.Tensor | None = None,
    use_pdl: bool = True,
) -> torch.Tensor:
    """Causal attention of a few query tokens per sequence (decode, verify) over paged K/V.

    q [T, Hq, D] (sequence b's tokens are rows query_start_loc[b]:query_start_loc[b+1], at most
    ``MAX_ROWS // G`` per sequence); caches [num_blocks, block_size, Hkv, D]. Returns
    [T, Hq, D] (``out`` if given); rows past query_start_loc[B] are left unwritten.
    ``num_splits`` and ``tiles`` override the defaults (benchmarks and tuning).
    """
    check_attention_inputs(q, k_cache, v_cache, meta)
    num_seqs, (num_tokens, num_q_heads, head_dim) = meta.seq_lens.shape[0], q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    assert is_short_query(meta.max_query_len, num_q_heads, num_kv_heads), "query too long"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1 and out.dtype == q.dtype
    if num_seqs == 0 or num_tokens == 0 or meta.max_query_len == 0:
        return out
    block_m = max(16, triton.next_power_of_2(meta.max_query_len * group_size))
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, meta.max_seq_len, block_m, q.device)
    tiles = tiles or DecodeTiles(block_n=64 if head_dim <= 128 else 32)
    direct = num_splits == 1
    if direct:
        part_out, part_lse = out, out  # part_lse unused
        po_strides, pl_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        part_out = q.new_empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32)
        po_strides, pl_strides = part_out.stride()[:3], part_lse.stride()[:2]
    _split_kv_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), *po_strides, *pl_strides, num_splits,
        GROUP_SIZE=group_size, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=max(tiles.block_n, block_size), DIRECT_OUT=direct,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(q.device, use_pdl),
    )  # fmt: skip
    if not direct:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_out, part_lse, meta.query_start_loc, out, *po_strides, *pl_strides,
            out.stride(0), out.stride(1), num_seqs, num_splits, HEAD_DIM=head_dim,
            SPLITS_PAD=MAX_SPLITS, num_warps=4,
            **launch_options(q.device, use_pdl),
        )  # fmt: skip
    return out


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_m: int, device: torch.device
) -> int:
    """Split-K factor: a target number of programs per SM, chunks of at least one key tile.

    Measured on an H200 (132 SMs, Qwen2.5-7B heads, CUDA-graph timings): decode (16-row tiles)
    was fastest at about 4 programs per SM (512 programs at batch 8 and 64), verify (64-row
    tiles, 4x the math per K/V byte) at about 2; at batch 1 more splits kept helping down to
    64-token chunks.
    """
    num_programs = num_seqs * num_kv_heads
    target = _num_sms(device) * (4 if block_m <= 16 else 2)
    wanted = (target + num_programs // 2) // num_programs  # rounded to nearest
    most = triton.cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, most, MAX_SPLITS))


_SM_COUNTS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: any value exercises the same code
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
