"""Skinny GEMV with its fused prologues (Triton) vs the torch references."""

from __future__ import annotations

import pytest
import torch

from verifypd.config import KernelConfig
from verifypd.kernels import reference, triton_ops
from verifypd.kernels.triton_gemv import (
    MAX_ROWS,
    PREFETCH_MODES,
    PROLOGUE_NONE,
    PROLOGUE_RMS_NORM,
    PROLOGUE_SILU_MUL,
    beats_gemm,
    choose_config,
    gemv,
    gemv_silu,
    reads_ahead,
    rms_norm_gemv,
    silu_mul_gemv,
)

SHAPES = [(40, 96), (17, 600), (130, 1030)]  # (N, K): neither divides the tiles
TILES = [{}, {"block_n": 4, "block_k": 64}, {"block_n": 16, "block_k": 1024}]


def _rand(target, *shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(target.dtype).to(target.device)


def _close(target, out, ref):
    torch.testing.assert_close(out, ref, rtol=target.rtol, atol=target.atol * 4)


@pytest.mark.parametrize("num_rows", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_matches_linear(target, num_rows, n, k, with_bias, with_residual):
    gen = torch.Generator().manual_seed(n + k + num_rows)
    wide = _rand(target, num_rows, k + 8, gen=gen)
    x = wide[:, 3 : 3 + k]  # a strided row view
    weight = _rand(target, n, k, gen=gen, scale=0.1)
    bias = _rand(target, n, gen=gen) if with_bias else None
    residual = _rand(target, num_rows, n, gen=gen) if with_residual else None

    out = gemv(x, weight, bias, residual)

    _close(target, out, reference.linear(x, weight, bias, residual))


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rms_norm_gemv_matches_norm_then_linear(target, tiles, num_rows, with_bias):
    n, k = 70, 600
    gen = torch.Generator().manual_seed(num_rows)
    x = _rand(target, num_rows, k, gen=gen, scale=3.0)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(target.dtype).to(target.device)
    weight = _rand(target, n, k, gen=gen, scale=0.1)
    bias = _rand(target, n, gen=gen) if with_bias else None

    out = rms_norm_gemv(x, norm_weight, 1e-6, weight, bias, **tiles)

    _close(target, out, reference.rms_norm_linear(x, norm_weight, 1e-6, weight, bias))


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("num_rows", [1, 4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_silu_mul_gemv_matches_swiglu_then_linear(target, tiles, num_rows, with_residual):
    n, k = 33, 520
    gen = torch.Generator().manual_seed(10 + num_rows)
    gate_up = _rand(target, num_rows, 2 * k, gen=gen)
    weight = _rand(target, n, k, gen=gen, scale=0.1)
    residual = _rand(target, num_rows, n, gen=gen) if with_residual else None

    out = silu_mul_gemv(gate_up, weight, residual, **tiles)

    _close(target, out, reference.silu_mul_linear(gate_up, weight, residual))


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("num_rows", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(40, 96), (130, 1030)])
def test_gemv_silu_matches_gate_up_then_swiglu(target, tiles, num_rows, n, k):
    gen = torch.Generator().manual_seed(20 + num_rows + n)
    x = _rand(target, num_rows, k, gen=gen)
    gate_up_weight = _rand(target, 2 * n, k, gen=gen, scale=0.2)

    out = gemv_silu(x, gate_up_weight, **tiles)

    assert out.shape == (num_rows, n)
    _close(target, out, reference.silu_and_mul(reference.linear(x, gate_up_weight)))


def test_gemv_silu_takes_several_rows_of_a_gate_up_weight(target):
    w = torch.zeros(32, 16, dtype=target.dtype, device=target.device)
    with pytest.raises(AssertionError, match="rows"):
        gemv_silu(torch.zeros(1, 16, dtype=target.dtype, device=target.device), w)
    with pytest.raises(AssertionError, match="2I"):
        gemv_silu(torch.zeros(3, 16, dtype=target.dtype, device=target.device), w[:31])


def test_gemv_rejects_bad_inputs(target):
    x = torch.zeros(MAX_ROWS + 1, 32, dtype=target.dtype, device=target.device)
    weight = torch.zeros(16, 32, dtype=target.dtype, device=target.device)
    with pytest.raises(AssertionError, match="rows"):
        gemv(x, weight)
    with pytest.raises(AssertionError, match="x: "):
        gemv(x[:1, :16], weight)
    with pytest.raises(AssertionError, match="dtype"):
        gemv(x[:1].double(), weight)
    with pytest.raises(AssertionError, match="residual"):
        gemv(x[:1], weight, None, torch.zeros_like(x[:1]))


@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("gemv_max_rows", [0, 1, 16])
def test_ops_dispatch_matches_reference(target, num_rows, fused, gemv_max_rows):
    """The GEMV (one row, prologues fused or not; several rows on tensor cores) or the norm
    and SwiGLU kernels + matmul: the same math whichever way a projection is dispatched."""
    ops = triton_ops.TritonOps(
        KernelConfig(fuse_norm=fused, fuse_silu=fused, gemv_max_rows=gemv_max_rows)
    )
    n, k = 48, 64
    gen = torch.Generator().manual_seed(num_rows)
    x, residual = _rand(target, num_rows, k, gen=gen), _rand(target, num_rows, k, gen=gen)
    norm_weight = _rand(target, k, gen=gen)
    weight, bias = _rand(target, n, k, gen=gen, scale=0.1), _rand(target, n, gen=gen)
    gate_up = _rand(target, num_rows, 2 * n, gen=gen)
    down = _rand(target, k, n, gen=gen, scale=0.1)

    _close(
        target,
        ops.rms_norm_linear(x, norm_weight, 1e-6, weight, bias),
        reference.rms_norm_linear(x, norm_weight, 1e-6, weight, bias),
    )
    for b in (None, bias):
        _close(target, ops.linear(x, weight, b), reference.linear(x, weight, b))
    # The residual is handed over (the ops may write the sum into it): each call gets a copy.
    _close(target, ops.linear(gate_up[:, :n], down, None, residual.clone()),
           reference.linear(gate_up[:, :n], down, None, residual))  # fmt: skip
    _close(
        target,
        ops.silu_mul_linear(gate_up, down, residual.clone()),
        reference.silu_mul_linear(gate_up, down, residual),
    )


@pytest.mark.parametrize("num_rows", [1, 3, 16, 20])
@pytest.mark.parametrize("epilogue", [False, True])
def test_mlp_block_matches_reference(target, num_rows, epilogue):
    """The SwiGLU block whichever way it is split: prologues at one row, SwiGLU on the gate_up
    epilogue at 2..16 rows (or the separate kernels), cuBLAS past 16."""
    ops = triton_ops.TritonOps(KernelConfig(fuse_silu_epilogue=epilogue))
    hidden, inter = 64, 80
    gen = torch.Generator().manual_seed(30 + num_rows)
    residual = _rand(target, num_rows, hidden, gen=gen)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(target.dtype)
    norm_weight = norm_weight.to(target.device)
    gate_up = _rand(target, 2 * inter, hidden, gen=gen, scale=0.2)
    down = _rand(target, hidden, inter, gen=gen, scale=0.1)

    out = ops.mlp(residual.clone(), norm_weight, 1e-6, gate_up, down)

    _close(target, out, reference.mlp(residual, norm_weight, 1e-6, gate_up, down))


def test_cublas_projection_adds_into_the_residual_stream(monkeypatch):
    """Past the GEMV rows the residual add rides on the GEMM epilogue and the sum is written
    into the residual stream itself: out-of-place addmm would first copy the residual into a
    new tensor (a device copy per projection, two per layer), so no ``torch.addmm`` runs."""
    ops = triton_ops.TritonOps(KernelConfig(gemv_max_rows=0))
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(20, 32, generator=gen), torch.randn(24, 32, generator=gen)
    residual = torch.randn(20, 24, generator=gen)
    expected = reference.linear(x, weight, None, residual)
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: pytest.fail("out-of-place addmm"))

    out = ops.linear(x, weight, None, residual)

    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out, expected)


def test_cublas_keeps_narrow_long_k_projections_at_several_rows():
    assert beats_gemm(1, 1536, 8960)  # one row: always the GEMV
    assert not beats_gemm(5, 1536, 8960)  # too few programs over a long K
    assert beats_gemm(5, 4608, 3584) and beats_gemm(16, 151936, 896)
    assert not beats_gemm(MAX_ROWS + 1, 4608, 3584)


@pytest.mark.parametrize("prologue", [PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL])
@pytest.mark.parametrize("num_rows", [1, 2, 16])
@pytest.mark.parametrize("n,k", [(1152, 896), (2048, 1536), (37888, 3584), (3584, 18944)])
def test_configs_are_power_of_two_tiles(prologue, num_rows, n, k):
    cfg = choose_config(prologue, num_rows, n, k)
    for size in (cfg.block_n, cfg.block_k, cfg.num_warps):
        assert size > 0 and size & (size - 1) == 0
    assert cfg.block_n >= (16 if num_rows > 1 else 1)  # tensor-core tiles need 16 columns


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemm_split_rows_gives_the_one_gemm_sums(target, with_bias, with_residual, monkeypatch):
    """``KernelConfig.gemm_split_rows``: a projection over more rows runs one GEMM per block
    of rows (the last one short) with the same result as one GEMM, into the residual stream
    or a new tensor; at most that many rows stay one GEMM."""
    calls: list[int] = []
    split_linear = triton_ops.split_linear
    monkeypatch.setattr(triton_ops, "split_linear",
                        lambda *a: calls.append(a[-1]) or split_linear(*a))  # fmt: skip
    whole, split = triton_ops.TritonOps(), triton_ops.TritonOps(KernelConfig(gemm_split_rows=64))
    n, k, rows = 40, 96, 150
    gen = torch.Generator().manual_seed(rows + with_bias + 2 * with_residual)
    x, residual = _rand(target, rows, k, gen=gen), _rand(target, rows, n, gen=gen)
    weight, bias = _rand(target, n, k, gen=gen, scale=0.1), _rand(target, n, gen=gen)
    b = bias if with_bias else None
    res = lambda: residual.clone() if with_residual else None  # noqa: E731 - handed over
    out = split.linear(x, weight, b, res())
    _close(target, out, whole.linear(x, weight, b, res()))
    assert out.shape == (rows, n) and calls == [64]
    _close(target, split.linear(x[:64], weight, b), whole.linear(x[:64], weight, b))
    assert calls == [64]  # 64 rows: one GEMM


@pytest.mark.parametrize("bad", [-1, 1, 63, 64.0, True])
def test_gemm_split_rows_is_validated(bad):
    with pytest.raises(ValueError, match="gemm_split_rows"):
        KernelConfig(gemm_split_rows=bad)


@pytest.mark.parametrize("prefetch", PREFETCH_MODES)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("tiles", [{}, {"block_n": 16, "block_k": 64}])
def test_weights_read_ahead_give_the_same_sums(target, prefetch, num_rows, tiles):
    """``prefetch``: the weight tiles read one step ahead (the first before the wait) change
    nothing in any of the four GEMV forms, over one K tile or many (1030 = 17 tiles of 64, the
    last one short); several rows never read ahead."""
    n, k = 130, 1030
    gen = torch.Generator().manual_seed(40 + num_rows)
    x, residual = _rand(target, num_rows, k, gen=gen), _rand(target, num_rows, n, gen=gen)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(target.dtype).to(target.device)
    weight, bias = _rand(target, n, k, gen=gen, scale=0.1), _rand(target, n, gen=gen)
    gate_up = _rand(target, num_rows, 2 * k, gen=gen)
    knobs = {"prefetch": prefetch, **tiles}

    _close(target, gemv(x, weight, bias, residual, **knobs),
           reference.linear(x, weight, bias, residual))  # fmt: skip
    _close(target, rms_norm_gemv(x, norm_weight, 1e-6, weight, bias, **knobs),
           reference.rms_norm_linear(x, norm_weight, 1e-6, weight, bias))  # fmt: skip
    _close(target, silu_mul_gemv(gate_up, weight, residual, **knobs),
           reference.silu_mul_linear(gate_up, weight, residual))  # fmt: skip
    if num_rows > 1:
        gate_up_weight = _rand(target, 2 * n, k, gen=gen, scale=0.2)
        _close(target, gemv_silu(x, gate_up_weight, **knobs),
               reference.silu_and_mul(reference.linear(x, gate_up_weight)))  # fmt: skip


def test_auto_reads_ahead_only_programs_of_wide_k_tiles_at_one_row():
    assert reads_ahead("auto", 1, 1024) and not reads_ahead("auto", 1, 512)
    assert reads_ahead("all", 1, 256) and not reads_ahead("off", 1, 1024)
    assert not reads_ahead("all", 2, 1024)  # tensor-core tiles: never


def test_an_unknown_prefetch_is_refused(target):
    x = torch.zeros(1, 32, dtype=target.dtype, device=target.device)
    with pytest.raises(ValueError, match="prefetch"):
        gemv(x, torch.zeros(16, 32, dtype=target.dtype, device=target.device), prefetch="l2")


@pytest.mark.parametrize("prefetch", PREFETCH_MODES)
def test_ops_hand_the_weight_prefetch_to_every_gemv(target, prefetch, monkeypatch):
    """``KernelConfig.weight_prefetch`` reaches each GEMV form the ops dispatch to."""
    seen: list[tuple[str, str]] = []

    def spy(name):
        real = getattr(triton_ops, name)
        return lambda *a, **kw: seen.append((name, kw["prefetch"])) or real(*a, **kw)

    for name in ("gemv", "rms_norm_gemv", "silu_mul_gemv", "gemv_silu"):
        monkeypatch.setattr(triton_ops, name, spy(name))
    ops = triton_ops.TritonOps(KernelConfig(weight_prefetch=prefetch))
    gen = torch.Generator().manual_seed(3)
    hidden, inter = 32, 48
    norm_weight = torch.ones(hidden, dtype=target.dtype, device=target.device)
    gate_up = _rand(target, 2 * inter, hidden, gen=gen, scale=0.2)
    down = _rand(target, hidden, inter, gen=gen, scale=0.1)
    for rows in (1, 3):
        residual = _rand(target, rows, hidden, gen=gen)
        ops.mlp(residual, norm_weight, 1e-6, gate_up, down)
        ops.rms_norm_linear(residual, norm_weight, 1e-6, gate_up)

    assert {name for name, _ in seen} == {"gemv", "rms_norm_gemv", "silu_mul_gemv", "gemv_silu"}
    assert {p for _, p in seen} == {prefetch}
