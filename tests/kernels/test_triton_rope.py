"""rope (Triton, in place) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_rope import rope


def _cos_sin_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq  # [P, D/2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 32), (7, 1, 64), (6, 2, 16)])
def test_rope_on_fused_qkv_views(target, num_q_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_tokens, max_pos = 9, 50
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(target.dtype).to(target.device)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k_end = (num_q_heads + num_kv_heads) * head_dim
    k = qkv[:, num_q_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(target.device)
    cache = _cos_sin_cache(max_pos, head_dim).to(target.device)
    ref_q, ref_k = reference.rope(q.clone(), k.clone(), positions, cache)
    v_before = qkv[:, k_end:].clone()

    out_q, out_k = rope(q, k, positions, cache)
    torch.testing.assert_close(out_q, ref_q, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(out_k, ref_k, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(qkv[:, k_end:], v_before, rtol=0, atol=0)  # v untouched
