"""The Triton kernels as plain functions with the torch reference signatures.

``verifypd.kernels.reference`` defines the semantics; every function here matches it (up to
floating-point rounding) and launches without host syncs, so a decode step can be captured in a
CUDA graph. ``paged_attention`` picks the split-K kernel when every sequence has only a few query
tokens (decode, speculative verify: ``max_query_len * G <= 64``, host-side ints only), or when a
uniform step comes cut into such short pieces (``metadata.uniform_pieces``: a drafter's
catch-up chunk graphs), and the variable-length prefill kernel otherwise (prefill chunks,
extends, mixed batches). The projections of a single token (batch-1 decode) run on the GEMV
kernel with their neighbouring norm, SwiGLU or bias folded in; more rows go to cuBLAS after the
separate kernels.

Which kernel runs where is ``KernelConfig`` (GEMV row limit, fusions, PDL): a ``TritonOps``
holds one such choice. The module-level functions are the default choice.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from verifypd.config import KernelConfig
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
    from verifypd.kernels.metadata import AttentionMetadata, AttentionSplit

__all__ = [
    "TritonOps",
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


class TritonOps:
    """The projection and attention ops under one kernel choice (``KernelConfig``); each
    method has its torch reference's signature."""

    def __init__(self, knobs: KernelConfig | None = None) -> None:
        knobs = knobs or KernelConfig()
        self.knobs = knobs
        # Unpacked: read on every projection of an eager step.
        self.gemv_max_rows = knobs.gemv_max_rows
        self.fuse_norm = knobs.fuse_norm and knobs.gemv_max_rows >= 1
        self.fuse_norm_max_n = knobs.fuse_norm_max_n
        self.fuse_silu = knobs.fuse_silu and knobs.gemv_max_rows >= 1
        self.fuse_silu_epilogue = knobs.fuse_silu_epilogue
        self.use_pdl = knobs.pdl
        self.gemv_knobs = {"use_pdl": knobs.pdl, "prefetch": knobs.weight_prefetch}
        self.gemm_split_rows = knobs.gemm_split_rows
        # The two kernels the model calls directly, under this choice's PDL.
        self.rms_norm = functools.partial(rms_norm, use_pdl=knobs.pdl)
        self.rope_store_kv = functools.partial(rope_store_kv, use_pdl=knobs.pdl)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal GQA attention of the packed query tokens q [T, Hq, D] over the paged cache;
        ``k_new``, ``v_new``: the same tokens' rotated keys and values (see ``reference``)."""
        if meta.split is not None:  # one-token rows, then a prompt chunk: a kernel each
            return self._split_attention(q, k_cache, v_cache, meta.split, scale, k_new, v_new)
        if is_short_query(meta.max_query_len, q.shape[1], k_cache.shape[2]):
            return decode_attention(q, k_cache, v_cache, meta, scale, use_pdl=self.use_pdl)
        pieces = meta.pieces  # a uniform step cut into pieces that fit the split-K kernel
        heads = (q.shape[1], k_cache.shape[2])
        if pieces is not None and is_short_query(pieces.max_query_len, *heads):
            return decode_attention(q, k_cache, v_cache, pieces, scale, use_pdl=self.use_pdl)
        return prefill_attention(q, k_cache, v_cache, meta, scale, k_new=k_new, v_new=v_new)

    def _split_attention(self, q, k_cache, v_cache, split: AttentionSplit, scale, k_new, v_new):
        """The decode rows on the split-K kernel, the chunk on the prefill kernel, one output."""
        out = torch.empty_like(q)
        n = split.num_decode_rows
        decode_attention(q[:n], k_cache, v_cache, split.decode, scale, out=out[:n],
                         use_pdl=self.use_pdl)  # fmt: skip
        prefill_attention(q, k_cache, v_cache, split.prompt, scale, k_new=k_new, v_new=v_new,
                          out=out)  # fmt: skip
        return out

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [T, K] @ weight[N, K]^T (+ bias) (+ residual [T, N])`` -> [T, N]. The residual
        stream is the caller's to give up: past the GEMV rows the sum is written into it."""
        if 0 < x.shape[0] <= self.gemv_max_rows and beats_gemm(x.shape[0], *weight.shape):
            return gemv(x, weight, bias, residual, **self.gemv_knobs)
        if 0 < self.gemm_split_rows < x.shape[0]:
            return split_linear(x, weight, bias, residual, self.gemm_split_rows)
        if residual is not None and bias is None:
            # The add rides on the GEMM epilogue (beta = 1). In place: out-of-place addmm first
            # copies the residual into a new tensor, a device copy per projection (56 per 7B
            # step, each a kernel in the graph).
            return residual.addmm_(x, weight.t())
        out = F.linear(x, weight, bias)
        return out if residual is None else out + residual

    def rms_norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of x [T, K] then the projection -> [T, N]."""
        if self.fuse_norm and x.shape[0] == 1 and weight.shape[0] <= self.fuse_norm_max_n:
            return rms_norm_gemv(x, norm_weight, eps, weight, bias, **self.gemv_knobs)
        normed, _ = rms_norm(x, norm_weight, eps, use_pdl=self.use_pdl)
        return self.linear(normed, weight, bias)

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SwiGLU of gate_up [T, 2I] then the projection (+ residual [T, N]) -> [T, N]."""
        if self.fuse_silu and gate_up.shape[0] == 1:
            return silu_mul_gemv(gate_up, weight, residual, **self.gemv_knobs)
        return self.linear(silu_and_mul(gate_up), weight, None, residual)

    def mlp(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Pre-norm SwiGLU block -> residual + MLP [T, H]. One row: the norm and SwiGLU fold
        into the projections' prologues; 2..16 rows: SwiGLU into gate_up's epilogue; more:
        cuBLAS."""
        rows = residual.shape[0]
        if (
            self.fuse_silu_epilogue
            and 1 < rows <= self.gemv_max_rows
            and beats_gemm(rows, *gate_up_weight.shape)
        ):
            normed, _ = rms_norm(residual, norm_weight, eps, use_pdl=self.use_pdl)
            gated = gemv_silu(normed, gate_up_weight, **self.gemv_knobs)
            return self.linear(gated, down_weight, None, residual)
        gate_up = self.rms_norm_linear(residual, norm_weight, eps, gate_up_weight)
        return self.silu_mul_linear(gate_up, down_weight, residual)


def split_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    rows: int,
) -> torch.Tensor:
    """``TritonOps.linear`` past the GEMV rows, one GEMM per block of ``rows`` rows
    (``KernelConfig.gemm_split_rows``): each output row is the same sum, written in place into
    the residual stream or into one output tensor."""
    wt = weight.t()
    blocks = [slice(a, a + rows) for a in range(0, x.shape[0], rows)]
    if residual is not None and bias is None:
        for b in blocks:
            residual[b].addmm_(x[b], wt)
        return residual
    out = x.new_empty(x.shape[0], weight.shape[0])
    for b in blocks:
        if bias is None:
            torch.mm(x[b], wt, out=out[b])
        else:
            torch.addmm(bias, x[b], wt, out=out[b])
    return out if residual is None else out.add_(residual)


_DEFAULT = TritonOps()
paged_attention = _DEFAULT.paged_attention
linear = _DEFAULT.linear
rms_norm_linear = _DEFAULT.rms_norm_linear
silu_mul_linear = _DEFAULT.silu_mul_linear
mlp = _DEFAULT.mlp
