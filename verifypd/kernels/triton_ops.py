"""The Triton kernels as plain functions with the torch reference signatures.

``verifypd.kernels.reference`` defines the semantics; every function here matches it (up to
floating-point rounding) and launches without host syncs, so a decode step can be captured in a
CUDA graph. ``paged_attention`` picks the split-K kernel when every sequence has only a few query
tokens (decode, speculative verify: ``max_query_len * G <= 64``, host-side ints only) and the
variable-length prefill kernel otherwise (prefill chunks, extends, mixed batches). The
projections of a single token (batch-1 decode) run on the GEMV kernel with their neighbouring
norm, SwiGLU or bias folded in; more rows go to cuBLAS after the separate kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from verifypd.kernels.triton_decode_attention import decode_attention, is_short_query
from verifypd.kernels.triton_gemv import (
    beats_gemm,
    gemv,
    gemv_silu,
    rms_norm_gemv,
    silu_mul_gemv,
)
from verifypd.kernels.triton_prefill_attention import prefill_attention
from verifypd.kernels.triton_rms_norm import rms_norm
from verifypd.kernels.triton_rope import rope
from verifypd.kernels.triton_rope_store import rope_store_kv
from verifypd.kernels.triton_silu_mul import silu_and_mul
from verifypd.kernels.triton_store_kv import store_kv

if TYPE_CHECKING:
    from verifypd.kernels.metadata import AttentionMetadata

__all__ = [
    "linear",
    "mlp",
    "paged_attention",
    "rms_norm",
    "rms_norm_linear",
    "rope",
    "rope_store_kv",
    "silu_and_mul",
    "silu_mul_linear",
    "store_kv",
]
# Rows up to which a projection may run on the GEMV kernel (``beats_gemm`` says for which
# shapes). Measured on an H200 (bench/gemv.py, bench/latency.py): at one row it beats cuBLAS
# on every Qwen2.5 projection (cuBLAS also adds split-K reduction launches); at 2..16 rows
# (batched decode, verify of 1 + L tokens) its tensor-core path beats cuBLAS on most of them.
GEMV_MAX_ROWS = 16
# Whether the GEMV folds the preceding RMSNorm / SwiGLU in (one launch) or a separate kernel
# runs first. Every GEMV program re-reads its input, and a prologue widens that re-read: on an
# H200 (bench/gemv.py) the fused norm won on the narrow q/k/v projection and lost on gate_up
# (thousands of programs), the fused SwiGLU broke even or won. Both only at one row: on the
# tensor-core path (several rows) every fused prologue lost.
FUSE_NORM = True
FUSE_NORM_MAX_N = 8192
FUSE_SILU = True
# At 2..16 rows SwiGLU rides on the gate_up projection's epilogue instead (once per output).
FUSE_SILU_EPILOGUE = True


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of the packed query tokens q [T, Hq, D] over the paged cache."""
    if is_short_query(meta.max_query_len, q.shape[1], k_cache.shape[2]):
        return decode_attention(q, k_cache, v_cache, meta, scale)
    return prefill_attention(q, k_cache, v_cache, meta, scale)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, K] @ weight[N, K]^T (+ bias) (+ residual [T, N])`` -> [T, N]."""
    if 0 < x.shape[0] <= GEMV_MAX_ROWS and beats_gemm(x.shape[0], *weight.shape):
        return gemv(x, weight, bias, residual)
    if residual is not None and bias is None:
        return torch.addmm(residual, x, weight.t())  # the add rides on the GEMM epilogue
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of x [T, K] then the projection -> [T, N]."""
    if FUSE_NORM and x.shape[0] == 1 and GEMV_MAX_ROWS >= 1 and weight.shape[0] <= FUSE_NORM_MAX_N:
        return rms_norm_gemv(x, norm_weight, eps, weight, bias)
    normed, _ = rms_norm(x, norm_weight, eps)
    return linear(normed, weight, bias)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """SwiGLU of gate_up [T, 2I] then the projection (+ residual [T, N]) -> [T, N]."""
    if FUSE_SILU and gate_up.shape[0] == 1 and GEMV_MAX_ROWS >= 1:
        return silu_mul_gemv(gate_up, weight, residual)
    return linear(silu_and_mul(gate_up), weight, None, residual)


def mlp(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
) -> torch.Tensor:
    """Pre-norm SwiGLU block -> residual + MLP [T, H]. One row: the norm and SwiGLU fold into
    the projections' prologues; 2..16 rows: SwiGLU into gate_up's epilogue; more: cuBLAS."""
    rows = residual.shape[0]
    if FUSE_SILU_EPILOGUE and 1 < rows <= GEMV_MAX_ROWS and beats_gemm(rows, *gate_up_weight.shape):
        normed, _ = rms_norm(residual, norm_weight, eps)
        return linear(gemv_silu(normed, gate_up_weight), down_weight, None, residual)
    gate_up = rms_norm_linear(residual, norm_weight, eps, gate_up_weight)
    return silu_mul_linear(gate_up, down_weight, residual)
