"""Skinny matmul ``out = prologue(x) W^T (+ b) (+ residual)`` for one to a few rows, Triton.

At batch-1 decode the projections are matrix-vector products: every weight byte is read once,
so the time is the weight bytes over the memory bandwidth plus the fixed cost of each launch.
This kernel streams W once and folds the cheap per-row work around a projection into it:

* ``PROLOGUE_RMS_NORM``: the input is ``rms_norm(x) * norm_weight`` (the pre-norm of the
  attention or MLP block). Since the normalisation is one scale per row, the kernel multiplies
  by ``norm_weight`` on the fly, accumulates the row's sum of squares in the same pass and scales
  the dot products once at the end (the reference rounds the normalised input first; the two
  agree to rounding).
* ``PROLOGUE_SILU_MUL``: x = [gate | up] and the input is ``silu(gate) * up`` (SwiGLU).
* ``HAS_BIAS``: the q/k/v bias of Qwen2. ``HAS_RESIDUAL``: ``+ residual [M, N]``, so the
  o and down projections write the next residual stream directly.
* ``SILU_OUT`` (epilogue, 2..16 rows): W = [W_gate; W_up] is [2N, K] and the output is
  ``silu(x W_gate^T) * (x W_up^T)`` [M, N]: each program accumulates its gate and up columns
  side by side and applies SwiGLU once per output, where the prologue form would redo it for
  every program (at several rows that prologue lost badly to a separate kernel).

Weights are the one input no kernel of a step writes, so at one row a program may read its
first weight tile before it waits for the previous kernel, and each later tile one step ahead
(``prefetch``; under PDL the previous kernel is still running then).

Every program re-reads its input rows (L2-resident) for its BLOCK_N outputs; the prologues
make that re-read a little wider, which is why the ops layer fuses them only where measured
to pay off (``bench/gemv.py``). Grid: one program per BLOCK_N output columns, looping over K
in BLOCK_K tiles, partial sums in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from verifypd.kernels.pdl import launch_options, wait_for_previous

PROLOGUE_NONE = 0
PROLOGUE_RMS_NORM = 1
PROLOGUE_SILU_MUL = 2
MAX_ROWS = 16  # one tensor-core tile of rows; more rows are a GEMM's job
# KernelConfig.weight_prefetch: which one-row programs read their first K tile of W before
# the wait for the previous kernel, and every later tile one step ahead: none ("off"), those
# that take K in tiles of at least AUTO_MIN_BLOCK_K ("auto": the latency-bound projections of
# the small models, where it won on an H200; on the 7B's 512-wide tiles it lost), or all.
PREFETCH_MODES = ("off", "auto", "all")
AUTO_MIN_BLOCK_K = 1024


# Ints that change from step to step are not specialized (Triton would compile a variant
# for 1 / multiples of 16): a batch shape first seen under traffic must not compile mid-run.
@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(
    x_ptr,  # [M, K], or [M, 2K] = [gate | up] for PROLOGUE_SILU_MUL
    norm_weight_ptr,  # [K], read for PROLOGUE_RMS_NORM
    w_ptr,  # [N, K]
    bias_ptr,  # [N], read when HAS_BIAS
    residual_ptr,  # [M, N], read when HAS_RESIDUAL (may be out itself)
    out_ptr,  # [M, N]
    num_rows,
    N,
    K,
    eps,
    stride_x_m,
    stride_w_n,
    stride_r_m,
    stride_o_m,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    M_PAD: tl.constexpr,  # 1, or a power of two >= max(16, num_rows): tensor-core tiles
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SILU_OUT: tl.constexpr,  # W is [2N, K] = [gate; up]; out = silu(gate) * up (M_PAD > 1)
    PREFETCH_TILE: tl.constexpr,  # one row: W's tiles read a step ahead, the first one early
    USE_PDL: tl.constexpr,
):
    # Weights are never written by a kernel of the step, so reading W may start before the
    # wait (under PDL: while the previous kernel still runs).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w_n  # [BLOCK_N, 1]
    if PREFETCH_TILE:  # the first K tile into registers; each step loads the next
        first_mask = n_mask[:, None] & (offs_kb < K)[None, :]
        w_next = tl.load(w_rows + offs_kb[None, :], mask=first_mask, other=0.0,
                         eviction_policy="evict_first")  # fmt: skip
    wait_for_previous(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < num_rows
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x_m  # [M_PAD, 1]

    sum_sq = tl.zeros([M_PAD], dtype=tl.float32)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)  # SILU_OUT: the up columns
    acc_1row = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # M_PAD == 1: reduce at the end
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kb
        k_mask = offs_k < K
        mk_mask = m_mask[:, None] & k_mask[None, :]
        if PROLOGUE == 2:
            gate = tl.load(x_rows + offs_k[None, :], mask=mk_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + offs_k[None, :], mask=mk_mask, other=0.0).to(tl.float32)
            silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            a = (silu * up).to(dtype).to(tl.float32)
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=mk_mask, other=0.0).to(tl.float32)
            if PROLOGUE == 1:
                sum_sq += tl.sum(a * a, axis=1)
                nw = tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                a = a * nw[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        if PREFETCH_TILE:  # this tile came with the last step; load the next one
            next_k = offs_k[None, :] + BLOCK_K
            next_mask = n_mask[:, None] & (next_k < K)
            w = w_next.to(tl.float32)  # [BLOCK_N, BLOCK_K]
            w_next = tl.load(w_rows + next_k, mask=next_mask, other=0.0,
                             eviction_policy="evict_first")  # fmt: skip
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)  # fmt: skip
        if M_PAD == 1:
            acc_1row += w.to(tl.float32) * a  # a: [1, BLOCK_K]
        else:  # [M_PAD, BLOCK_K] x [BLOCK_K, BLOCK_N] on tensor cores, in the input dtype
            acc += tl.dot(a.to(dtype), tl.trans(w.to(dtype)), input_precision=DOT_PRECISION)
            if SILU_OUT:
                w_up = tl.load(w_rows + N * stride_w_n + offs_k[None, :], mask=w_mask,
                               other=0.0, eviction_policy="evict_first")  # fmt: skip
                acc_up += tl.dot(
                    a.to(dtype), tl.trans(w_up.to(dtype)), input_precision=DOT_PRECISION
                )
    if M_PAD == 1:
        acc += tl.sum(acc_1row, axis=1)[None, :]
    if PROLOGUE == 1:
        acc *= tl.rsqrt(sum_sq / K + eps)[:, None]
    if SILU_OUT:  # rounded as the unfused path rounds: gate_up, silu(gate), the product
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + offs_m[:, None].to(tl.int64) * stride_r_m + offs_n[None, :]
        acc += tl.load(r_ptrs, mask=mn_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_o_m + offs_n[None, :]
    tl.store(out_ptrs, acc.to(dtype), mask=mn_mask)


def beats_gemm(num_rows: int, n: int, k: int) -> bool:
    """Whether this kernel was measured faster than cuBLAS for the shape (H200, bench/gemv.py):
    always at one row; at 2..16 rows except narrow outputs over a long K (too few programs)."""
    if num_rows == 1:
        return True
    return num_rows <= MAX_ROWS and not (n <= 2048 and k >= 4096)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_config(
    prologue: int, num_rows: int, n: int, k: int, silu_out: bool = False
) -> GemvConfig:
    """Tile sizes from the shape (host ints only, so CUDA-graph capture sees one choice).

    Tuned on an H200 with ``bench/gemv.py`` on the Qwen2.5 0.5B/1.5B/7B projections. One row:
    wide outputs (gate_up, LM head) want 16-row tiles of 256 columns; narrow ones (q/k/v, o,
    down) want 4-row tiles (8 behind a prologue, which re-reads the input per program) and the
    longest K tile that does not leave a mostly empty last tile. Several rows: tensor-core
    tiles of 16 rows. ``silu_out`` (n = I outputs, two weight tiles per step): the tiles of the
    [2I, K] projection with half the columns each.
    """
    if silu_out:
        cfg = choose_config(prologue, num_rows, 2 * n, k)
        return cfg._replace(block_n=max(16, cfg.block_n // 2))
    if num_rows > 1:
        if n > 8192:
            block_k = 256 if k >= 1536 and n > 65536 else 128
            return GemvConfig(block_n=64, block_k=block_k, num_warps=4, num_stages=3)
        if n <= 2048:
            return GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)
        if n <= 4096 or k >= 8192:
            return GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
        return GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)
    if n > 8192 and prologue != PROLOGUE_SILU_MUL:  # a norm prologue too (fuse_norm_max_n)
        return GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=3)
    long_k = k <= 2048 or k % 512 != 0
    block_n = 4 if prologue == PROLOGUE_NONE or n < 1024 else 8
    num_warps = 8 if long_k or prologue == PROLOGUE_SILU_MUL else 4
    return GemvConfig(block_n=block_n, block_k=1024 if long_k else 512, num_warps=num_warps,
                      num_stages=3)  # fmt: skip


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    use_pdl: bool = True,
    prefetch: str = "auto",
    **config,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias [N]) (+ residual [M, N])`` -> [M, N], M <= MAX_ROWS.

    ``prefetch`` (a ``PREFETCH_MODES`` name; one row) reads ``weight`` before the previous
    kernel's writes are waited for: only for weights no kernel of the step writes. So do the
    other forms."""
    return _launch(PROLOGUE_NONE, x, weight, bias, residual, config, use_pdl, prefetch)


def rms_norm_gemv(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_pdl: bool = True,
    prefetch: str = "auto",
    **config,
) -> torch.Tensor:
    """``(rms_norm(x) * norm_weight) @ weight^T (+ bias)`` -> [M, N]."""
    assert norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous(), "norm_weight: [K]"
    return _launch(
        PROLOGUE_RMS_NORM, x, weight, bias, None, config, use_pdl, prefetch,
        norm=(norm_weight, eps),
    )  # fmt: skip


def gemv_silu(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    *,
    use_pdl: bool = True,
    prefetch: str = "auto",
    **config,
) -> torch.Tensor:
    """``silu(x @ W_gate^T) * (x @ W_up^T)`` with gate_up_weight [2I, K] = [W_gate; W_up] ->
    [M, I]; 2..MAX_ROWS rows (one row folds SwiGLU into the down projection instead)."""
    assert gate_up_weight.shape[0] % 2 == 0, "gate_up_weight: [2I, K]"
    assert x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS, f"gemv_silu takes 2..{MAX_ROWS} rows"
    return _launch(
        PROLOGUE_NONE, x, gate_up_weight, None, None, config, use_pdl, prefetch, silu_out=True
    )


def silu_mul_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    use_pdl: bool = True,
    prefetch: str = "auto",
    **config,
) -> torch.Tensor:
    """``(silu(gate) * up) @ weight^T (+ residual)`` with gate_up [M, 2K] = [gate | up]."""
    return _launch(PROLOGUE_SILU_MUL, gate_up, weight, None, residual, config, use_pdl, prefetch)


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    config: dict,
    use_pdl: bool,
    prefetch: str,
    norm: tuple[torch.Tensor, float] | None = None,
    silu_out: bool = False,
) -> torch.Tensor:
    num_rows = x.shape[0]
    n, k = weight.shape
    if silu_out:
        n //= 2  # outputs: the gate half; the kernel reads the up rows N rows further on
    in_width = 2 * k if prologue == PROLOGUE_SILU_MUL else k
    assert x.dim() == 2 and x.shape[1] == in_width, f"x: [M, {in_width}], got {tuple(x.shape)}"
    assert 1 <= num_rows <= MAX_ROWS, f"gemv takes 1..{MAX_ROWS} rows, got {num_rows}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x, weight: last dim must be contiguous"
    assert weight.dtype == x.dtype, "x and weight must share a dtype"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous() and bias.dtype == x.dtype, "bias: [N]"
    if residual is not None:
        assert residual.shape == (num_rows, n) and residual.stride(1) == 1, "residual: [M, N]"
        assert residual.dtype == x.dtype, "residual must share x's dtype"
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    cfg = choose_config(prologue, num_rows, n, k, silu_out)._replace(**config)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    pdl = launch_options(x.device, use_pdl)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, norm_weight, weight, bias if bias is not None else x,
        residual if residual is not None else out, out, num_rows, n, k, eps,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        M_PAD=1 if num_rows == 1 else max(16, triton.next_power_of_2(num_rows)),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SILU_OUT=silu_out,
        PREFETCH_TILE=reads_ahead(prefetch, num_rows, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    return out


def reads_ahead(prefetch: str, num_rows: int, block_k: int) -> bool:
    """Whether the program reads W a tile ahead (``PREFETCH_TILE``) under ``prefetch``."""
    if prefetch not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}")
    if prefetch == "off" or num_rows != 1:
        return False
    return prefetch == "all" or block_k >= AUTO_MIN_BLOCK_K
