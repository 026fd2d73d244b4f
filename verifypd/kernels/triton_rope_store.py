"""Fused rotary embedding + KV-cache store for the decode hot path (Triton).

One launch instead of ``rope`` then ``store_kv``: one program per token reads its cos/sin row
once, rotates all query heads in place (rotate-half, NeoX / HF style), writes the rotated key
heads straight into the paged cache at the token's slot and back into the input buffer (where
the prompt-attention kernel reads the step's own keys), and copies the value heads to the cache.
A negative slot marks a padding token (CUDA-graph batches are padded): its query and key are
still rotated, the caches are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verifypd.kernels.pdl import launch_options, wait_for_previous
from verifypd.kernels.triton_rope import load_cos_sin, rotate_in_place, rotated_halves


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,  # [T, Hq, D], rotated in place
    k_ptr,  # [T, Hkv, D], rotated in place
    v_ptr,  # [T, Hkv, D], read only
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_pos, D] = [cos(D/2) | sin(D/2)]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [T] int64, flat slot = block_id * BLOCK_SIZE + offset, < 0: skip
    num_q_heads,
    num_kv_heads,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cs_p,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_DIM: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,  # next power of two >= num_q_heads
    KV_HEADS_PAD: tl.constexpr,  # next power of two >= num_kv_heads
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_DIM)
    cos, sin = load_cos_sin(cos_sin_ptr, positions_ptr, t, stride_cs_p, offs_d, HALF_DIM)

    # q: rotated in place, padding tokens included.
    rotate_in_place(q_ptr, t, stride_q_t, stride_q_h, num_q_heads, offs_d, cos, sin,
                    Q_HEADS_PAD, HALF_DIM)  # fmt: skip

    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_hk = tl.arange(0, KV_HEADS_PAD)
    # A padding token (slot < 0) gets all-false k/v masks. (A tensor & scalar-bool mask would be
    # simpler, but Triton's interpreter mistypes that as int32.)
    num_heads_written = tl.where(slot >= 0, num_kv_heads, 0)
    is_head_written = offs_hk[:, None] < num_heads_written  # [Hkv_pad, 1]

    # k: rotated in registers, written back in place (padding tokens included) and into the
    # cache, rounded to k's dtype first so that the cache holds what rope-then-store_kv would
    # have written.
    k_heads = (offs_hk[:, None] < num_kv_heads) & (offs_d[None, :] < HALF_DIM)  # [Hkv_pad, D/2]
    k_mask = is_head_written & (offs_d[None, :] < HALF_DIM)  # [Hkv_pad, D/2]
    k1_ptrs = k_ptr + t * stride_k_t + offs_hk[:, None] * stride_k_h + offs_d[None, :]
    k1, k2 = rotated_halves(k1_ptrs, k_heads, cos, sin, HALF_DIM)
    k1_rot = k1.to(k_ptr.dtype.element_ty)
    k2_rot = k2.to(k_ptr.dtype.element_ty)
    tl.store(k1_ptrs, k1_rot, mask=k_heads)
    tl.store(k1_ptrs + HALF_DIM, k2_rot, mask=k_heads)
    k1_rot = k1_rot.to(k_cache_ptr.dtype.element_ty)
    k2_rot = k2_rot.to(k_cache_ptr.dtype.element_ty)
    dst_k = block_id * stride_kc_b + offset * stride_kc_s + offs_hk[:, None] * stride_kc_h
    kc1_ptrs = k_cache_ptr + dst_k + offs_d[None, :]
    tl.store(kc1_ptrs, k1_rot, mask=k_mask)
    tl.store(kc1_ptrs + HALF_DIM, k2_rot, mask=k_mask)

    # v: copied as is.
    offs_dv = tl.arange(0, HEAD_DIM)
    v_mask = is_head_written & (offs_dv[None, :] < HEAD_DIM)  # [Hkv_pad, D]
    src_v = v_ptr + t * stride_v_t + offs_hk[:, None] * stride_v_h + offs_dv[None, :]
    v = tl.load(src_v, mask=v_mask, other=0.0)
    dst_v = block_id * stride_vc_b + offset * stride_vc_s + offs_hk[:, None] * stride_vc_h
    tl.store(
        v_cache_ptr + dst_v + offs_dv[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_mask
    )


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_pdl: bool = True,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place, store the rotated k and v [T, Hkv, D] at
    ``slot_mapping``.

    positions, slot_mapping: [T] int64 (slot < 0: padding, caches untouched); cos_sin_cache:
    [max_pos, D]; caches: [num_blocks, block_size, Hkv, D]. q, k, v may be strided views (e.g.
    slices of a fused qkv projection); v is not modified. Returns q. No host sync.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    block_size = k_cache.shape[1]
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert v.shape == k.shape, "k and v must have the same shape"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "q, k, v: last dim stride"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache: last dim must be contiguous"
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, "caches: [N, bs, Hkv, D]"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache head shape differs from k"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache: last dim contiguous"
    assert head_dim >= 2 and _is_pow2(head_dim), "D must be a power of two"
    assert _is_pow2(block_size), "block size must be a power of two"
    if num_tokens == 0:
        return q
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HALF_DIM=head_dim // 2,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), num_warps=4,
        **launch_options(q.device, use_pdl),
    )  # fmt: skip
    return q


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
