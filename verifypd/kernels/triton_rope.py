"""Rotary position embedding, NeoX / Hugging Face rotate-half style, in place (Triton).

With x = [x1 | x2] (halves of the head dim) and cos, sin of the token's position:
x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. One program per token rotates all of its query
and key heads, so the cos/sin row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, Hq, D], rotated in place
    k_ptr,  # [T, Hkv, D], rotated in place
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_pos, D] = [cos(D/2) | sin(D/2)]
    num_q_heads,
    num_kv_heads,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cs_p,
    HALF_DIM: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_DIM)
    cos, sin = load_cos_sin(cos_sin_ptr, positions_ptr, t, stride_cs_p, offs_d, HALF_DIM)

    rotate_in_place(q_ptr, t, stride_q_t, stride_q_h, num_q_heads, offs_d, cos, sin,
                    Q_HEADS_PAD, HALF_DIM)  # fmt: skip
    rotate_in_place(k_ptr, t, stride_k_t, stride_k_h, num_kv_heads, offs_d, cos, sin,
                    KV_HEADS_PAD, HALF_DIM)  # fmt: skip


@triton.jit
def rotate_in_place(
    ptr, t, stride_t, stride_h, num_heads, offs_d, cos, sin,
    HEADS_PAD: tl.constexpr, HALF_DIM: tl.constexpr,
):  # fmt: skip
    """Rotates token t's first ``num_heads`` heads (of ``HEADS_PAD``) in place."""
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF_DIM)  # [H_pad, D/2]
    first = ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1, x2 = rotated_halves(first, mask, cos, sin, HALF_DIM)
    tl.store(first, x1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF_DIM, x2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_cos_sin(cos_sin_ptr, positions_ptr, t, stride_cs_p, offs_d, HALF_DIM: tl.constexpr):
    """cos and sin rows [1, D/2] (fp32) of token t's position."""
    row = cos_sin_ptr + tl.load(positions_ptr + t) * stride_cs_p
    cos = tl.load(row + offs_d).to(tl.float32)[None, :]
    sin = tl.load(row + HALF_DIM + offs_d).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def rotated_halves(x1_ptrs, mask, cos, sin, HALF_DIM: tl.constexpr):
    """Loads the halves x1 (at x1_ptrs) and x2 (HALF_DIM further) -> rotated (x1', x2') fp32."""
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by ``positions [T]``; returns (q, k).

    q and k may be strided views (e.g. slices of a fused qkv projection)."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert q.stride(2) == 1 and k.stride(2) == 1, "q, k: last dim must be contiguous"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache: last dim must be contiguous"
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, "D must be a power of two"
    if num_tokens == 0:
        return q, k
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, num_q_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF_DIM=head_dim // 2, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]), num_warps=4,
    )  # fmt: skip
    return q, k
