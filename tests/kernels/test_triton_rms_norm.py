"""rms_norm (Triton) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_rms_norm import rms_norm


def _inputs(target, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    residual = torch.randn(shape, generator=gen)
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    return (t.to(target.dtype).to(target.device) for t in (x, residual, weight))


@pytest.mark.parametrize("shape", [(5, 64), (3, 576), (4, 3, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(target, shape, with_residual):
    x, residual, weight = _inputs(target, shape)
    res = residual if with_residual else None
    out, res_out = rms_norm(x, weight, 1e-5, res)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-5, res)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref_out, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(res_out, ref_res, rtol=0, atol=0)
    if not with_residual:
        assert res_out is x


def test_rms_norm_fp32_weight_on_strided_rows(target):
    x, _, weight = _inputs(target, (6, 2, 96), seed=1)
    x = x[:, 0]  # [6, 96] with row stride 192
    weight = weight.float()
    out, _ = rms_norm(x, weight, 1e-6)
    ref_out, _ = reference.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, rtol=target.rtol, atol=target.atol)
