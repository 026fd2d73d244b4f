"""Skinny GEMV with its fused prologues (Triton) vs the torch references."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference, triton_ops
from verifypd.kernels.triton_gemv import MAX_ROWS, gemv, rms_norm_gemv, silu_mul_gemv

SHAPES = [(40, 96), (17, 600), (130, 1030)]  # (N, K): neither divides the tiles
TILES = [{}, {"block_n": 4, "block_k": 64}, {"block_n": 16, "block_k": 1024}]


def _rand(target, *shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(target.dtype).to(target.device)


def _close(target, out, ref):
    torch.testing.assert_close(out, ref, rtol=target.rtol, atol=target.atol * 4)


@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(target, num_rows, n, k, with_bias):
    gen = torch.Generator().manual_seed(n + k + num_rows)
    wide = _rand(target, num_rows, k + 8, gen=gen)
    x = wide[:, 3 : 3 + k]  # a strided row view
    weight = _rand(target, n, k, gen=gen, scale=0.1)
    bias = _rand(target, n, gen=gen) if with_bias else None

    _close(target, gemv(x, weight, bias), reference.linear(x, weight, bias))


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv_matches_norm_then_linear(target, tiles, num_rows, with_residual):
    n, k = 70, 600
    gen = torch.Generator().manual_seed(num_rows)
    x = _rand(target, num_rows, k, gen=gen)
    residual = _rand(target, num_rows, k, gen=gen) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(target.dtype).to(target.device)
    weight = _rand(target, n, k, gen=gen, scale=0.1)
    bias = _rand(target, n, gen=gen)

    out, res_out = rms_norm_gemv(x, residual, norm_weight, 1e-6, weight, bias, **tiles)

    ref_out, ref_res = reference.rms_norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
    _close(target, out, ref_out)
    torch.testing.assert_close(res_out, ref_res, rtol=target.rtol, atol=target.atol)
    if not with_residual:
        assert res_out is x


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("num_rows", [1, 4])
def test_silu_mul_gemv_matches_swiglu_then_linear(target, tiles, num_rows):
    n, k = 33, 520
    gen = torch.Generator().manual_seed(10 + num_rows)
    gate_up = _rand(target, num_rows, 2 * k, gen=gen)
    weight = _rand(target, n, k, gen=gen, scale=0.1)

    out = silu_mul_gemv(gate_up, weight, **tiles)

    _close(target, out, reference.silu_mul_linear(gate_up, weight))


def test_gemv_rejects_bad_inputs(target):
    x = torch.zeros(MAX_ROWS + 1, 32, dtype=target.dtype, device=target.device)
    weight = torch.zeros(16, 32, dtype=target.dtype, device=target.device)
    with pytest.raises(AssertionError, match="rows"):
        gemv(x, weight)
    with pytest.raises(AssertionError, match="x: "):
        gemv(x[:1, :16], weight)
    with pytest.raises(AssertionError, match="dtype"):
        gemv(x[:1].double(), weight)


@pytest.mark.parametrize("num_rows", [1, 3])
def test_ops_dispatch_matches_reference_for_any_row_count(target, num_rows):
    """One row goes through the GEMV, more through norm/SwiGLU kernels + matmul: same math."""
    n, k = 48, 64
    gen = torch.Generator().manual_seed(num_rows)
    x, residual = _rand(target, num_rows, k, gen=gen), _rand(target, num_rows, k, gen=gen)
    norm_weight = _rand(target, k, gen=gen)
    weight, bias = _rand(target, n, k, gen=gen, scale=0.1), _rand(target, n, gen=gen)
    gate_up = _rand(target, num_rows, 2 * n, gen=gen)
    down = _rand(target, k, n, gen=gen, scale=0.1)

    out, res = triton_ops.rms_norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
    ref_out, ref_res = reference.rms_norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
    _close(target, out, ref_out)
    _close(target, res, ref_res)
    _close(target, triton_ops.linear(x, weight, bias), reference.linear(x, weight, bias))
    _close(
        target,
        triton_ops.silu_mul_linear(gate_up, down),
        reference.silu_mul_linear(gate_up, down),
    )
