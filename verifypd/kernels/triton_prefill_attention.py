"""Paged prefill / extend / verify attention with variable query lengths (Triton).

Sequence b has q_len = query_start_loc[b+1] - query_start_loc[b] new tokens at positions
seq_len - q_len .. seq_len - 1; each attends causally to every earlier position. store_kv has
already written the new tokens' K/V, so every key can come from the paged cache via the block
table (the new tokens' own keys may come from their qkv rows instead, below).

Grid (query tiles, B, Hkv). GQA head packing: a tile's BLOCK_M rows are (token, head) pairs,
TOKENS_PER_TILE = BLOCK_M // G consecutive query tokens times the G query heads of one KV head,
so each K/V tile is loaded once for the whole group. This matters most for the verify pass
(1 + L tokens per sequence): 5 tokens x 7 heads fill one 64-row tile instead of 7 mostly empty
ones. Keys below the tile's first query position need no causal mask and run in a mask-free
loop; the last few key tiles (the diagonal) run masked. Online softmax in fp32, log2 domain.

The new tokens' own keys and values can be read from where the projection left them (``k_new``,
``v_new``: rows of the fused qkv buffer, the keys rotated in place by ``rope_store_kv``) instead
of through the block table: plain strided rows, which Triton's pipeliner prefetches (with three
stages), where the paged gather waits on each tile's block ids. The cached prefix still comes
from the pages. Query tiles run last-first: under the causal mask a later tile has more keys,
and starting the longest first leaves no long tile alone in the last wave. On an H100 (7B heads)
the three took one layer's attention over a 2,048-token prompt from 0.205 to 0.133 ms and over
4,096 tokens from 0.469 to 0.345 (torch's flash SDPA: 0.094 / 0.254), and a 7B prompt step's
attention from 3.6 to 2.6 ms (2,048 tokens) and 12.6 to 9.9 ms (4,096):
bench/results/kernels/prefill-attention-variants-nvidia-h100-32502ff.json and
bench/results/profile/profile_prefill-nvidia-h100-80gb-hbm3-{base-32502ff,new-ef86447}-*.json.
With the new tokens' rows, the cached prefix runs in tiles of twice BLOCK_N keys with each
tile's block ids loaded one tile ahead (``attend_prefix``): 1.0-1.4x over long prefixes on an
H200 (bench/results/kernels/prefill-attention-prefix-variants-nvidia-h200-79ddd05.json).
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
    attend_tile,
    check_attention_inputs,
    dot_precision,
    fold_scores,
)

if TYPE_CHECKING:
    from verifypd.kernels.metadata import AttentionMetadata

LONG_QUERY = 1024  # query tokens from which the prefill tiles pipeline three stages


@triton.jit
def attend_prefix(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr,
    prefix_end,  # keys [0, prefix_end) are the cached prefix, visible to every row
    q_pos, kv_head, qk_scale,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over a sequence's cached prefix: whole tiles with each tile's block ids
    loaded one tile ahead (so the keys' loads do not wait on them and the pipeliner can run
    ahead), then the partial last tile masked."""
    full = prefix_end // BLOCK_N * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_block = offs_n % BLOCK_SIZE  # tiles start at multiples of BLOCK_N, of BLOCK_SIZE too
    block_ids = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=offs_n < full, other=0)
    for tile_start in range(0, full, BLOCK_N):
        following = tile_start + BLOCK_N + offs_n
        next_ids = tl.load(table_row_ptr + following // BLOCK_SIZE, mask=following < full, other=0)
        ids = block_ids.to(tl.int64)
        k_off = ids * stride_kc_b + in_block * stride_kc_s + kv_head * stride_kc_h
        v_off = ids * stride_vc_b + in_block * stride_vc_s + kv_head * stride_vc_h
        k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :])  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        acc, m_i, l_i = fold_scores(s, v, acc, m_i, l_i, DOT_PRECISION)
        block_ids = next_ids
    for tile_start in range(full, prefix_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, tile_start, q_pos,
            prefix_end, kv_head, qk_scale, stride_kc_b, stride_kc_s, stride_kc_h,
            stride_vc_b, stride_vc_s, stride_vc_h, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
            DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def attend_new_tile(
    q, acc, m_i, l_i,
    k_new_ptr,  # [T, Hkv, D] rows of this step's tokens (keys already rotated)
    v_new_ptr,
    first_row,  # the sequence's first token row in k_new / v_new
    j_start,  # first key of the tile, as an index into the sequence's new tokens
    tok,  # [BLOCK_M] each row's query token index within the sequence's new tokens
    num_new,  # keys at new-token index >= num_new are never read
    kv_head, qk_scale, stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile of online softmax over the new tokens' contiguous keys."""
    offs_j = j_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (first_row + offs_j).to(tl.int64)
    k_ptrs = k_new_ptr + rows[:, None] * stride_kn_t + kv_head * stride_kn_h + offs_d[None, :]
    v_ptrs = v_new_ptr + rows[:, None] * stride_vn_t + kv_head * stride_vn_h + offs_d[None, :]
    if MASKED:
        in_range = (offs_j < num_new)[:, None]
        k = tl.load(k_ptrs, mask=in_range, other=0.0)
        v = tl.load(v_ptrs, mask=in_range, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (offs_j[None, :] <= tok[:, None]) & (offs_j[None, :] < num_new)
        s = tl.where(visible, s, float("-inf"))
    return fold_scores(s, v, acc, m_i, l_i, DOT_PRECISION)


# Ints that change from step to step are not specialized (Triton would compile a variant
# for 1 / multiples of 16): a batch shape first seen under traffic must not compile mid-run.
@triton.jit(do_not_specialize=["stride_bt_b"])
def _prefill_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    k_new_ptr,  # [T, Hkv, D] the new tokens' rotated keys (NEW_CONTIG; else unused)
    v_new_ptr,  # [T, Hkv, D] their values
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    qk_scale,  # softmax scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_kn_t,
    stride_kn_h,
    stride_vn_t,
    stride_vn_h,
    stride_o_t,
    stride_o_h,
    stride_bt_b,
    GROUP_SIZE: tl.constexpr,  # G = Hq / Hkv
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block (page) size
    BLOCK_M: tl.constexpr,  # rows = (token, head) pairs
    BLOCK_N: tl.constexpr,  # keys per tile, a multiple of BLOCK_SIZE
    DOT_PRECISION: tl.constexpr,
    NEW_CONTIG: tl.constexpr,  # the new tokens' keys from k_new / v_new, not the pages
    PREFIX_N: tl.constexpr,  # keys per tile of the cached prefix (NEW_CONTIG)
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP_SIZE
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query tiles first
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len  # cached prefix before the new tokens
    first_tok = tile * TOKENS_PER_TILE
    num_tok = tl.maximum(tl.minimum(q_len - first_tok, TOKENS_PER_TILE), 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = first_tok + offs_m // GROUP_SIZE  # [BLOCK_M] query token index within the sequence
    heads = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M]
    row_valid = offs_m < num_tok * GROUP_SIZE
    row_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, D]
    rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # [BLOCK_M, D]
    q_pos = ctx_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + b * stride_bt_b
    if NEW_CONTIG:
        # The cached prefix from the pages (every key visible to every row), in tiles of
        # PREFIX_N keys ...
        prefix_end = tl.where(num_tok > 0, ctx_len, 0)
        acc, m_i, l_i = attend_prefix(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, prefix_end, q_pos, kv_head,
            qk_scale, stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s,
            stride_vc_h, HEAD_DIM, BLOCK_SIZE, PREFIX_N, DOT_PRECISION,
        )  # fmt: skip
        # ... then the new tokens' own rows: whole tiles before the tile's first token
        # unmasked, the diagonal masked.
        new_end = tl.where(num_tok > 0, first_tok + num_tok, 0)
        new_full = tl.minimum(first_tok // BLOCK_N * BLOCK_N, new_end)
        for j_start in range(0, new_full, BLOCK_N):
            acc, m_i, l_i = attend_new_tile(
                q, acc, m_i, l_i, k_new_ptr, v_new_ptr, q_start, j_start, tok, new_end,
                kv_head, qk_scale, stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
                HEAD_DIM, BLOCK_N, False, DOT_PRECISION,
            )  # fmt: skip
        for j_start in range(new_full, new_end, BLOCK_N):
            acc, m_i, l_i = attend_new_tile(
                q, acc, m_i, l_i, k_new_ptr, v_new_ptr, q_start, j_start, tok, new_end,
                kv_head, qk_scale, stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
                HEAD_DIM, BLOCK_N, True, DOT_PRECISION,
            )  # fmt: skip
    else:
        kv_end = tl.where(num_tok > 0, ctx_len + first_tok + num_tok, 0)  # one past the last key
        # Keys < ctx_len + first_tok are visible to every row: whole tiles of them go unmasked.
        full_end = tl.minimum((ctx_len + first_tok) // BLOCK_N * BLOCK_N, kv_end)
        acc, m_i, l_i = attend_range(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, 0, full_end, kv_end, q_pos,
            kv_head, qk_scale, stride_kc_b, stride_kc_s, stride_kc_h,
            stride_vc_b, stride_vc_s, stride_vc_h, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape; BLOCK_M rows are (token, head) pairs, BLOCK_N is raised to the block size."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2


def default_prefill_tiles(max_query_len: int, group_size: int, head_dim: int) -> PrefillTiles:
    """Small row tiles for short (verify) queries, 128 rows for long prefills; three pipeline
    stages from 1,024 query tokens (on an H100 they beat two by 1.2-1.5x on 2-4k-token prompts
    and lost on four 512-token ones)."""
    rows = max_query_len * group_size
    block_m = max(min(128, triton.next_power_of_2(rows)), 16, triton.next_power_of_2(group_size))
    block_n = 64 if head_dim <= 128 else 32
    stages = 3 if max_query_len >= LONG_QUERY else 2
    return PrefillTiles(block_m, block_n, num_warps=8 if block_m >= 128 else 4, num_stages=stages)


def launch_tiles(tiles: PrefillTiles, block_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, PREFIX_N, stages) of a launch: BLOCK_N raised to the KV block size; the cached
    prefix in tiles of twice that up to 128 keys; three stages only with tiles of at most 64
    keys (three of 128-key K and V tiles and a 128-row Q tile fill an H100's shared memory)."""
    block_n = max(tiles.block_n, block_size)
    prefix_n = 2 * block_n if block_n <= 64 else block_n
    stages = tiles.num_stages if block_n <= 64 else min(tiles.num_stages, 2)
    return block_n, prefix_n, stages


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    q [T, Hq, D] (sequence b's tokens are rows query_start_loc[b]:query_start_loc[b+1]);
    caches [num_blocks, block_size, Hkv, D]. ``k_new``, ``v_new`` [T, Hkv, D] (strided views
    allowed, last dim contiguous): the same tokens' rotated keys and values, as stored in the
    cache; given, the kernel reads the new tokens' keys from them and only the cached prefix
    from the pages. Returns [T, Hq, D] (``out`` if given); rows past query_start_loc[B] are
    left unwritten. ``tiles`` overrides the launch shape (tuning).
    """
    check_attention_inputs(q, k_cache, v_cache, meta)
    num_seqs, (num_q_heads, head_dim) = meta.seq_lens.shape[0], q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1 and out.dtype == q.dtype
    contig = k_new is not None
    if contig:
        assert v_new is not None, "k_new and v_new come together"
        kv_shape = (q.shape[0], num_kv_heads, head_dim)
        assert k_new.shape == v_new.shape == kv_shape, "k_new, v_new: [T, Hkv, D]"
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1, "k_new, v_new: last dim stride"
        assert k_new.dtype == v_new.dtype == q.dtype, "k_new, v_new: q's dtype"
    else:
        assert v_new is None, "k_new and v_new come together"
        k_new = v_new = q  # unused by the kernel
    if num_seqs == 0 or q.shape[0] == 0 or meta.max_query_len == 0:
        return out
    tiles = tiles or default_prefill_tiles(meta.max_query_len, group_size, head_dim)
    assert tiles.block_m >= group_size, "a row tile must hold a whole GQA group"
    grid = (triton.cdiv(meta.max_query_len, tiles.block_m // group_size), num_seqs, num_kv_heads)
    block_n, prefix_n, stages = launch_tiles(tiles, block_size)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, k_new, v_new, out, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, scale * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        GROUP_SIZE=group_size, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
        NEW_CONTIG=contig, PREFIX_N=prefix_n, num_warps=tiles.num_warps, num_stages=stages,
    )  # fmt: skip
    return out
