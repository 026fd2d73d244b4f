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
from verifypd.kernels.triton_gemv import gemv, rms_norm_gemv, silu_mul_gemv
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
    "paged_attention",
    "rms_norm",
    "rms_norm_linear",
    "rope",
    "rope_store_kv",
    "silu_and_mul",
    "silu_mul_linear",
    "store_kv",
]
# Rows up to which a projection runs on the GEMV kernel. Measured on an H200 (bench/gemv.py):
# at one row it beats cuBLAS on every Qwen2.5 projection (cuBLAS also adds split-K reduction
# launches); its several-row path is slower than cuBLAS, so it is not used.
GEMV_MAX_ROWS = 1


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, K] @ weight[N, K]^T (+ bias)`` -> [T, N]."""
    if x.shape[0] <= GEMV_MAX_ROWS and x.shape[0] > 0:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (after the residual add) then the projection -> (out [T, N], residual [T, K])."""
    if x.shape[0] <= GEMV_MAX_ROWS and x.shape[0] > 0:
        return rms_norm_gemv(x, residual, norm_weight, eps, weight, bias)
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), residual


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU of gate_up [T, 2I] then the projection -> [T, N]."""
    if gate_up.shape[0] <= GEMV_MAX_ROWS and gate_up.shape[0] > 0:
        return silu_mul_gemv(gate_up, weight)
    return F.linear(silu_and_mul(gate_up), weight)
