"""RMSNorm with an optional fused residual add (Triton).

One program per row: with a residual, r = x + residual is rounded to x's dtype (it is the
residual stream the next layer adds to) and normalised; statistics and scaling in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verifypd.kernels.pdl import launch_options, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [M, N]
    residual_ptr,  # [M, N], read only when HAS_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [M, N]
    residual_out_ptr,  # [M, N], written only when HAS_RESIDUAL
    n_cols,
    eps,
    stride_x_m,
    stride_r_m,
    stride_o_m,
    stride_ro_m,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x_m + offs, mask=mask, other=0.0)  # [BLOCK_N]
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r_m + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro_m + offs, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = x * inv_rms * w
    tl.store(out_ptr + row * stride_o_m + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    use_pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x) * weight, x)``, or with a residual ``r = x + residual``:
    ``(rms_norm(r) * weight, r)``. x [..., N] (e.g. [T, hidden] or per-head [T, H, D])."""
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,) and weight.is_contiguous(), "weight: [N], contiguous"
    assert x.stride(-1) == 1, "x: last dim must be contiguous"
    x2 = x.reshape(-1, n_cols)  # a view for the usual layouts
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res2, res_out = x2, x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1, "residual: last dim must be contiguous"
        res2, res_out = residual.reshape(-1, n_cols), torch.empty_like(out)
    res_out2 = res_out.reshape(-1, n_cols)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, res_out
    block_n = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        x2, res2, weight, out.view(-1, n_cols), res_out2, n_cols, eps,
        x2.stride(0), res2.stride(0), n_cols, res_out2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        **launch_options(x.device, use_pdl),
    )  # fmt: skip
    return out, res_out


def _num_warps(block_n: int) -> int:
    return min(16, max(1, block_n // 256))
