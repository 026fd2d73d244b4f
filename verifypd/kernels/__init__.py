"""Kernels: Triton kernels and their torch references, bundled behind one ``Ops`` table.

The model calls only ``Ops`` members, so the torch references (CPU, tests) and the Triton
kernels (GPU) are interchangeable: they share signatures and semantics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from verifypd.config import KernelConfig
from verifypd.kernels import reference
from verifypd.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "Ops", "get_ops"]


@dataclass(frozen=True)
class Ops:
    """The op table a model runs on; see ``kernels.reference`` for each op's contract."""

    store_kv: Callable[..., None]
    paged_attention: Callable[..., object]
    rms_norm: Callable[..., object]
    rope: Callable[..., object]
    silu_and_mul: Callable[..., object]
    rope_store_kv: Callable[..., object]
    linear: Callable[..., object]
    rms_norm_linear: Callable[..., object]
    silu_mul_linear: Callable[..., object]
    mlp: Callable[..., object]


REFERENCE_OPS = Ops(
    store_kv=reference.store_kv,
    paged_attention=reference.paged_attention,
    rms_norm=reference.rms_norm,
    rope=reference.rope,
    silu_and_mul=reference.silu_and_mul,
    rope_store_kv=reference.rope_store_kv,
    linear=reference.linear,
    rms_norm_linear=reference.rms_norm_linear,
    silu_mul_linear=reference.silu_mul_linear,
    mlp=reference.mlp,
)


def get_ops(use_triton: bool = False, knobs: KernelConfig | None = None) -> Ops:
    """The torch reference ops, or the Triton kernels when ``use_triton``, dispatched as
    ``knobs`` says (the references ignore it)."""
    if not use_triton:
        return REFERENCE_OPS
    return _triton_ops(knobs or KernelConfig())


def _triton_ops(knobs: KernelConfig) -> Ops:
    try:
        from verifypd.kernels import triton_ops
    except ImportError as exc:  # no triton installed, or the kernels module is missing
        raise RuntimeError(
            f"Triton ops are unavailable ({exc}); use use_triton=False (torch reference ops)"
        ) from exc
    chosen = triton_ops.TritonOps(knobs)
    # With PDL on (the kernels' default) the model calls the two kernels directly.
    direct = knobs.pdl
    return Ops(
        store_kv=triton_ops.store_kv,
        paged_attention=chosen.paged_attention,
        rms_norm=triton_ops.rms_norm if direct else chosen.rms_norm,
        rope=triton_ops.rope,
        silu_and_mul=triton_ops.silu_and_mul,
        rope_store_kv=triton_ops.rope_store_kv if direct else chosen.rope_store_kv,
        linear=chosen.linear,
        rms_norm_linear=chosen.rms_norm_linear,
        silu_mul_linear=chosen.silu_mul_linear,
        mlp=chosen.mlp,
    )
