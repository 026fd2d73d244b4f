"""store_kv (Triton) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_store_kv import store_kv


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 2, 32), (16, 3, 64)])
def test_store_kv_with_padding(target, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_blocks = 11, 6
    pool = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    pool = pool.to(target.dtype).to(target.device)
    # k, v as strided slices of one fused projection output [T, 2 * Hkv, D]
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(target.dtype)
    kv = kv.to(target.device)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(target.device)

    expected = pool.clone()
    reference.store_kv(k, v, expected[1, 0], expected[1, 1], slots)
    store_kv(k, v, pool[1, 0], pool[1, 1], slots)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0)  # other layer untouched too


def test_store_kv_empty(target):
    cache = torch.zeros(2, 4, 1, 32, dtype=target.dtype, device=target.device)
    k = cache.new_zeros(0, 1, 32)
    store_kv(k, k, cache, cache.clone(), torch.zeros(0, dtype=torch.int64, device=cache.device))
