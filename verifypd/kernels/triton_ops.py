"""The Triton kernels as plain functions with the torch reference signatures.

``verifypd.kernels.reference`` defines the semantics; every function here matches it (up to
floating-point rounding) and launches without host syncs, so a decode step can be captured in a
CUDA graph. ``paged_attention`` picks the split-K kernel when every sequence has only a few query
tokens (decode, speculative verify: ``max_query_len * G <= 64``, host-side ints only) and the
variable-length prefill kernel otherwise (prefill chunks, extends, mixed batches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verifypd.kernels.triton_decode_attention import decode_attention, is_short_query
from verifypd.kernels.triton_prefill_attention import prefill_attention
from verifypd.kernels.triton_rms_norm import rms_norm
from verifypd.kernels.triton_rope import rope
from verifypd.kernels.triton_silu_mul import silu_and_mul
from verifypd.kernels.triton_store_kv import store_kv

if TYPE_CHECKING:
    from verifypd.kernels.metadata import AttentionMetadata

__all__ = ["paged_attention", "rms_norm", "rope", "silu_and_mul", "store_kv"]


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
