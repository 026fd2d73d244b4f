"""The pieces the paged attention kernels share (``triton_prefill_attention``,
``triton_decode_attention``): one key tile of online softmax read through the block table
(``attend_tile``), the fold of a tile's scores into the running softmax (``fold_scores``), the
loop over a key range, unmasked whole tiles then the masked rest (``attend_range``); and the
wrappers' input checks and dot precision. Online softmax in fp32, log2 domain (scores scaled
by ``LOG2E``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from verifypd.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def attend_tile(
    q,  # [BLOCK_M, D]
    acc,  # [BLOCK_M, D] fp32
    m_i,  # [BLOCK_M] fp32, running max (log2 units)
    l_i,  # [BLOCK_M] fp32, running sum of exp2
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # this sequence's block table row
    tile_start,
    q_pos,  # [BLOCK_M] absolute position of each row's query token
    kv_end,  # keys at positions >= kv_end are never read
    kv_head,
    qk_scale,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of online softmax (also used by the split-K kernel)."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, HEAD_DIM)
    in_block = offs_n % BLOCK_SIZE
    if MASKED:
        n_mask = offs_n < kv_end
        kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_N, D]
        block_ids = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        block_ids = tl.load(table_row_ptr + offs_n // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)
    k_off = block_ids * stride_kc_b + in_block * stride_kc_s + kv_head * stride_kc_h
    v_off = block_ids * stride_vc_b + in_block * stride_vc_s + kv_head * stride_vc_h
    k_ptrs = k_cache_ptr + k_off[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + v_off[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)  # [BLOCK_N, D]
        v = tl.load(v_ptrs)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < kv_end)
        s = tl.where(visible, s, float("-inf"))
    return fold_scores(s, v, acc, m_i, l_i, DOT_PRECISION)


@triton.jit
def fold_scores(s, v, acc, m_i, l_i, DOT_PRECISION: tl.constexpr):
    """Folds one key tile's scores s [BLOCK_M, BLOCK_N] (scaled, log2 units, -inf where a row
    does not see the key) and values v [BLOCK_N, D] into the rows' running online softmax."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # -inf only for a row that has seen no visible key yet (possible in a split-K chunk).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_range(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr,
    start,  # first key position
    full_end,  # keys in [start, full_end) are visible to every row: whole tiles, unmasked
    kv_end,  # keys at positions >= kv_end are never read; [full_end, kv_end) is masked
    q_pos, kv_head, qk_scale,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over the keys [start, kv_end), tile by tile (also the split-K kernel's
    loop over its chunk)."""
    for tile_start in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, tile_start, q_pos, kv_end,
            kv_head, qk_scale, stride_kc_b, stride_kc_s, stride_kc_h,
            stride_vc_b, stride_vc_s, stride_vc_h,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for tile_start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, tile_start, q_pos, kv_end,
            kv_head, qk_scale, stride_kc_b, stride_kc_s, stride_kc_h,
            stride_vc_b, stride_vc_s, stride_vc_h,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Shape, stride and dtype checks shared by the decode and prefill wrappers."""
    num_seqs = meta.seq_lens.shape[0]
    assert q.dim() == 3 and q.stride(2) == 1, "q: [T, Hq, D], last dim contiguous"
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, "caches: [N, bs, Hkv, D]"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache: last dim contiguous"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q and caches must share a dtype"
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape[3] == head_dim and num_q_heads % num_kv_heads == 0
    assert _is_pow2(head_dim) and head_dim >= 16, "D must be a power of two >= 16"
    assert _is_pow2(block_size) and block_size >= 4, "block size must be a power of two >= 4"
    assert meta.query_start_loc.shape == (num_seqs + 1,), "query_start_loc: [B + 1]"
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        assert getattr(meta, name).dtype == torch.int32, f"{name} must be int32"
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == num_seqs
    assert meta.block_tables.stride(1) == 1, "block table rows must be contiguous"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
