"""SwiGLU activation: silu(gate) * up for x = [gate | up] (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I] = [gate | up]
    out_ptr,  # [T, I]
    inter_size,  # I
    stride_x_t,
    stride_o_t,
    BLOCK_I: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    mask = offs < inter_size
    gate = tl.load(x_ptr + t * stride_x_t + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x_t + inter_size + offs, mask=mask, other=0.0)
    out = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_o_t + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, "x: [T, 2I]"
    assert x.stride(1) == 1, "x: last dim must be contiguous"
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_i = min(1024, triton.next_power_of_2(inter_size))
    grid = (num_tokens, triton.cdiv(inter_size, block_i))
    _silu_and_mul_kernel[grid](
        x, out, inter_size, x.stride(0), out.stride(0), BLOCK_I=block_i, num_warps=4
    )
    return out
