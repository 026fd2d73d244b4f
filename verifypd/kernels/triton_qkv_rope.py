"""One token's q/k/v projection with RoPE and the KV-cache store in its epilogue (Triton).

At batch-1 decode an attention block begins with two kernels: the q/k/v GEMV (pre-norm and bias
folded in, ``triton_gemv``) and ``rope_store_kv``. Here one launch does both. Each program
computes ``BLOCK_N // 2`` column pairs (d, d + D/2) of one head, the first columns and their
partners in two accumulators, so the rotate-half rotation of a pair happens in the program that
computed it. It writes the q, k and v heads into the qkv output (q and k rotated; the attention
kernels read the step's own key and value there) and the k and v heads at the token's cache
slot (a negative slot is padding: the cache is left alone). Rounding follows the two-kernel
path: the projection is rounded to the output dtype, then rotated in fp32, then rounded again.

One row only (``KernelConfig.fuse_rope_store``); more rows keep the two kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verifypd.kernels.pdl import launch_options, wait_for_previous
from verifypd.kernels.triton_gemv import PROLOGUE_RMS_NORM, choose_config, reads_ahead


@triton.jit
def _qkv_rope_store_kernel(
    x_ptr,  # [K], the token's residual stream
    norm_weight_ptr,  # [K], read when HAS_NORM
    w_ptr,  # [N, K], N = (Hq + 2 Hkv) * D
    bias_ptr,  # [N], read when HAS_BIAS
    out_ptr,  # [N]
    positions_ptr,  # [1] int64
    cos_sin_ptr,  # [max_pos, D] = [cos(D/2) | sin(D/2)]
    slot_ptr,  # [1] int64, < 0: padding
    k_cache_ptr,  # [num_blocks, CACHE_BLOCK, Hkv, D]
    v_cache_ptr,
    K,
    eps,
    stride_w_n,
    stride_cs_p,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    num_q_heads,
    num_kv_heads,
    HAS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,  # column pairs per program (a power of two dividing D / 2)
    BLOCK_K: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    PREFETCH_TILE: tl.constexpr,  # W's first K tile read before the wait, each next one ahead
    USE_PDL: tl.constexpr,
):
    half_dim: tl.constexpr = HEAD_DIM // 2
    per_head: tl.constexpr = half_dim // HALF_BLOCK
    pid = tl.program_id(0)
    head = pid // per_head
    offs_h = (pid % per_head) * HALF_BLOCK + tl.arange(0, HALF_BLOCK)  # d in the first half
    offs_n1 = head * HEAD_DIM + offs_h  # the pairs' first columns; their partners D/2 on
    offs_kb = tl.arange(0, BLOCK_K)
    rows1 = w_ptr + offs_n1[:, None].to(tl.int64) * stride_w_n  # [HALF_BLOCK, 1]
    rows2 = rows1 + half_dim * stride_w_n
    if PREFETCH_TILE:  # weights: never written by a kernel of the step
        first_mask = (offs_kb < K)[None, :]
        w1_next = tl.load(rows1 + offs_kb[None, :], mask=first_mask, other=0.0,
                          eviction_policy="evict_first")  # fmt: skip
        w2_next = tl.load(rows2 + offs_kb[None, :], mask=first_mask, other=0.0,
                          eviction_policy="evict_first")  # fmt: skip
    wait_for_previous(USE_PDL)
    # The epilogue's inputs first: their latency hides behind the K loop's weight reads.
    row = cos_sin_ptr + tl.load(positions_ptr) * stride_cs_p
    cos = tl.load(row + offs_h).to(tl.float32)
    sin = tl.load(row + half_dim + offs_h).to(tl.float32)
    if HAS_BIAS:
        bias1 = tl.load(bias_ptr + offs_n1).to(tl.float32)
        bias2 = tl.load(bias_ptr + offs_n1 + half_dim).to(tl.float32)
    slot = tl.load(slot_ptr).to(tl.int64)

    sum_sq = tl.zeros([1], dtype=tl.float32)
    acc1 = tl.zeros([HALF_BLOCK, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([HALF_BLOCK, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kb
        k_mask = (offs_k < K)[None, :]
        a = tl.load(x_ptr + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            sum_sq += tl.sum(a * a, axis=1)
            nw = tl.load(norm_weight_ptr + offs_k[None, :], mask=k_mask, other=0.0)
            a = a * nw.to(tl.float32)
        if PREFETCH_TILE:
            next_k = offs_k[None, :] + BLOCK_K
            w1 = w1_next.to(tl.float32)
            w2 = w2_next.to(tl.float32)
            w1_next = tl.load(rows1 + next_k, mask=next_k < K, other=0.0,
                              eviction_policy="evict_first")  # fmt: skip
            w2_next = tl.load(rows2 + next_k, mask=next_k < K, other=0.0,
                              eviction_policy="evict_first")  # fmt: skip
        else:
            w1 = tl.load(rows1 + offs_k[None, :], mask=k_mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)  # fmt: skip
            w2 = tl.load(rows2 + offs_k[None, :], mask=k_mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)  # fmt: skip
        acc1 += w1 * a
        acc2 += w2 * a
    x1 = tl.sum(acc1, axis=1)  # [HALF_BLOCK]
    x2 = tl.sum(acc2, axis=1)
    if HAS_NORM:
        scale = tl.rsqrt(sum_sq / K + eps)
        x1 *= scale
        x2 *= scale
    if HAS_BIAS:
        x1 += bias1
        x2 += bias2
    dtype = out_ptr.dtype.element_ty
    x1 = x1.to(dtype).to(tl.float32)
    x2 = x2.to(dtype).to(tl.float32)

    # Rotate q and k heads (v heads pass through) at the token's position.
    is_rotated = offs_h * 0 + head < num_q_heads + num_kv_heads  # [HALF_BLOCK], all alike
    r1 = tl.where(is_rotated, x1 * cos - x2 * sin, x1).to(dtype)
    r2 = tl.where(is_rotated, x2 * cos + x1 * sin, x2).to(dtype)
    tl.store(out_ptr + offs_n1, r1)
    tl.store(out_ptr + offs_n1 + half_dim, r2)

    # k and v heads into the cache at the token's slot. Masks from row counts, not scalar
    # bools (Triton's interpreter mistypes a tensor & scalar-bool mask as int32).
    kv = head - num_q_heads  # 0 .. Hkv - 1: k heads; Hkv .. 2 Hkv - 1: v heads
    lanes = tl.arange(0, HALF_BLOCK)
    k_cols = tl.where((slot >= 0) & (kv >= 0) & (kv < num_kv_heads), HALF_BLOCK, 0)
    v_cols = tl.where((slot >= 0) & (kv >= num_kv_heads), HALF_BLOCK, 0)
    # Clamped so that no address leaves the caches, even where the store is masked off.
    block_id = tl.maximum(slot, 0) // CACHE_BLOCK
    offset = tl.maximum(slot, 0) % CACHE_BLOCK
    k_head = tl.minimum(tl.maximum(kv, 0), num_kv_heads - 1)
    v_head = tl.minimum(tl.maximum(kv - num_kv_heads, 0), num_kv_heads - 1)
    k_dst = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_s + k_head * stride_kc_h
    v_dst = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_s + v_head * stride_vc_h
    k_dtype = k_cache_ptr.dtype.element_ty
    v_dtype = v_cache_ptr.dtype.element_ty
    tl.store(k_dst + offs_h, r1.to(k_dtype), mask=lanes < k_cols)
    tl.store(k_dst + half_dim + offs_h, r2.to(k_dtype), mask=lanes < k_cols)
    tl.store(v_dst + offs_h, r1.to(v_dtype), mask=lanes < v_cols)
    tl.store(v_dst + half_dim + offs_h, r2.to(v_dtype), mask=lanes < v_cols)


def qkv_rope_store(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_pdl: bool = True,
    prefetch: str = "auto",
) -> torch.Tensor:
    """``(rms_norm(x) * norm_weight) @ weight^T (+ bias)`` for one token, q and k heads rotated,
    k and v stored at ``slot_mapping[0]`` -> qkv [1, (Hq + 2 Hkv) * D] (no norm when
    ``norm_weight`` is None). Shapes as ``rope_store_kv``'s; no host sync."""
    head_dim = cos_sin_cache.shape[1]
    n, k = weight.shape
    assert x.dim() == 2 and x.shape == (1, k) and x.stride(1) == 1, f"x: [1, {k}]"
    assert weight.stride(1) == 1 and weight.dtype == x.dtype, "weight: [N, K] of x's dtype"
    assert n == (num_q_heads + 2 * num_kv_heads) * head_dim, "weight rows: (Hq + 2 Hkv) * D"
    assert head_dim % 2 == 0, "D must be even"
    assert positions.shape == (1,) and slot_mapping.shape == (1,), "one token"
    assert positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache: last dim must be contiguous"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache: last dim contiguous"
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous(), "norm_weight: [K]"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous() and bias.dtype == x.dtype, "bias: [N]"
    cfg = choose_config(PROLOGUE_RMS_NORM, 1, n, k)
    half_block = cfg.block_n // 2  # pairs per program: a power of two dividing D / 2
    while (head_dim // 2) % half_block:
        half_block //= 2
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _qkv_rope_store_kernel[(n // (2 * half_block),)](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, out, positions, cos_sin_cache, slot_mapping,
        k_cache, v_cache, k, eps, weight.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HEAD_DIM=head_dim,
        HALF_BLOCK=half_block, BLOCK_K=cfg.block_k, CACHE_BLOCK=k_cache.shape[1],
        PREFETCH_TILE=reads_ahead(prefetch, 1, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device, use_pdl),
    )  # fmt: skip
    return out
