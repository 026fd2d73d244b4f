"""Scatter the new tokens' K and V into the paged KV cache (Triton).

One program per token writes all KV heads of that token; a negative slot marks a padding token
(CUDA-graph batches are padded) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [T] int64, flat slot = block_id * BLOCK_SIZE + offset, < 0: skip
    num_kv_heads,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= num_kv_heads
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    # A padding token (slot < 0) gets an all-false mask. (A tensor & scalar-bool mask would be
    # simpler, but Triton's interpreter mistypes that as int32.)
    num_heads_written = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (offs_h[:, None] < num_heads_written) & (offs_d[None, :] < HEAD_DIM)  # [HEADS_PAD, D]

    src_k = k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :]
    src_v = v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)  # [HEADS_PAD, HEAD_DIM]
    v = tl.load(src_v, mask=mask, other=0.0)

    dst_k = block_id * stride_kc_b + offset * stride_kc_s + offs_h[:, None] * stride_kc_h
    dst_v = block_id * stride_vc_b + offset * stride_vc_s + offs_h[:, None] * stride_vc_h
    tl.store(k_cache_ptr + dst_k + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k, v [T, Hkv, D]`` into the cache slots ``slot_mapping [T]`` (in place)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = k_cache.shape[1]
    assert v.shape == k.shape, "k and v must have the same shape"
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, "caches: [N, bs, Hkv, D]"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache head shape differs from k"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert k.stride(2) == 1 and v.stride(2) == 1, "k, v: last dim must be contiguous"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache: last dim contiguous"
    assert _is_pow2(block_size) and _is_pow2(head_dim), "block size and D: powers of two"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )  # fmt: skip


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
