"""Rotary embedding tables: inverse frequencies per ``rope_scaling`` type and the cos/sin cache.

Supported types (HF ``rope_type`` names): ``default``, ``linear``, ``llama3`` (Llama 3.1) and
``yarn``. The cache layout is what ``kernels.reference.rope`` reads:
``[max_pos, D] = cat(cos[:, :D/2], sin[:, :D/2])`` in fp32, already multiplied by the
attention factor (YaRN's mscale; 1 otherwise).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def build_cos_sin_cache(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int,
    device: torch.device | str | None = None,
) -> Tensor:
    """[max_positions, head_dim] fp32 cos/sin table for positions 0 .. max_positions - 1.

    Computed on the CPU (bitwise the same math as transformers) and then moved to ``device``.
    """
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)  # [P]
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    return cache.to(device)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[Tensor, float]:
    """Per-pair inverse frequencies [D/2] (fp32) and the attention factor for a scaling dict."""
    rope_type = _rope_type(scaling)
    inv_freq = _base_inv_freq(head_dim, theta)
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, max_positions), 1.0
    return _yarn(head_dim, theta, scaling, max_positions)


def _rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return rope_type


def _base_inv_freq(head_dim: int, theta: float) -> Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    return 1.0 / (theta**exponents)


def _original_context(scaling: dict[str, Any], max_positions: int) -> int:
    return int(scaling.get("original_max_position_embeddings") or max_positions)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any], max_positions: int) -> Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = _original_context(scaling, max_positions)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071): blend interpolated and extrapolated frequencies per dimension."""
    old_context = _original_context(scaling, max_positions)
    factor = float(scaling.get("factor") or max_positions / old_context)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = _yarn_mscale(factor, scaling)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    low, high = _yarn_correction_range(
        beta_fast, beta_slow, head_dim, theta, old_context, scaling.get("truncate", True)
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # [D/2]
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, scaling: dict[str, Any]) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def _yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, theta: float, context: int, truncate: bool
) -> tuple[float, float]:
    """Dimension range [low, high] over which YaRN ramps from extrapolation to interpolation."""

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(context / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
