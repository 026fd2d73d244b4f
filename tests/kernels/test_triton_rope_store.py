"""rope_store_kv (Triton, fused rope + store_kv) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_rope import rope
from verifypd.kernels.triton_rope_store import rope_store_kv
from verifypd.kernels.triton_store_kv import store_kv

HEAD_SHAPES = [(4, 4, 32), (7, 1, 64), (6, 2, 16), (8, 2, 128)]  # (Hq, Hkv, D)
NUM_BLOCKS, MAX_POS = 5, 50


def _cos_sin_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq  # [P, D/2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]


def _make_case(target, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, seed=0):
    """Fused qkv [T, (Hq + 2 Hkv) D], a random 2-layer KV pool and shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(target.dtype).to(target.device)
    pool_shape = (2, 2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    pool = torch.randn(pool_shape, generator=gen).to(target.dtype).to(target.device)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen).to(target.device)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens].to(target.device)
    cos_sin = _cos_sin_cache(MAX_POS, head_dim).to(target.device)
    return qkv, pool, positions, slots, cos_sin


def _split_qkv(qkv, num_q_heads, num_kv_heads, head_dim):
    """Views of a fused qkv output: q [T, Hq, D], k and v [T, Hkv, D] (token stride = width)."""
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    num_tokens = qkv.shape[0]
    q = qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEAD_SHAPES)
def test_rope_store_kv_on_fused_qkv_views(target, num_q_heads, num_kv_heads, head_dim, block_size):
    num_tokens = 9
    case = _make_case(target, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size)
    qkv, pool, positions, slots, cos_sin = case
    slots[[1, 6]] = -1  # padding tokens
    q, k, v = _split_qkv(qkv, num_q_heads, num_kv_heads, head_dim)
    v_before, pool_before = v.clone(), pool.clone()
    expected, ref_k = pool.clone(), k.clone()
    ref_q = reference.rope_store_kv(
        q.clone(), ref_k, v, positions, cos_sin, expected[1, 0], expected[1, 1], slots
    )

    out_q = rope_store_kv(q, k, v, positions, cos_sin, pool[1, 0], pool[1, 1], slots)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place, in the qkv buffer
    torch.testing.assert_close(q, ref_q, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(pool, expected, rtol=target.rtol, atol=target.atol)
    # k rotated in place too, padding rows included (the prompt-attention kernel reads it)
    torch.testing.assert_close(k, ref_k, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)
    # v is a plain copy: bit-exact in the cache.
    real = slots >= 0
    flat_v = pool[1, 1].flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
    torch.testing.assert_close(flat_v[slots[real]], v[real], rtol=0, atol=0)
    _assert_unwritten_rows_unchanged(pool, pool_before, slots[real])


def _assert_unwritten_rows_unchanged(pool, pool_before, written_slots):
    """Every cache row other than ``written_slots`` of layer 1 is bit-identical, layer 0 too."""
    torch.testing.assert_close(pool[0], pool_before[0], rtol=0, atol=0)
    flat = pool[1].flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
    flat_before = pool_before[1].flatten(1, 2)
    is_unwritten = torch.ones(flat.shape[1], dtype=torch.bool, device=flat.device)
    is_unwritten[written_slots] = False
    torch.testing.assert_close(flat[:, is_unwritten], flat_before[:, is_unwritten], rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [16, 8])
def test_rope_store_kv_all_padding_leaves_the_cache(target, block_size):
    num_q_heads, num_kv_heads, head_dim, num_tokens = 6, 2, 16, 5
    case = _make_case(target, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size)
    qkv, pool, positions, slots, cos_sin = case
    slots.fill_(-1)
    q, k, v = _split_qkv(qkv, num_q_heads, num_kv_heads, head_dim)
    pool_before = pool.clone()
    ref_q, ref_k = reference.rope(q.clone(), k.clone(), positions, cos_sin)

    rope_store_kv(q, k, v, positions, cos_sin, pool[1, 0], pool[1, 1], slots)
    torch.testing.assert_close(q, ref_q, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(k, ref_k, rtol=target.rtol, atol=target.atol)
    torch.testing.assert_close(pool, pool_before, rtol=0, atol=0)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEAD_SHAPES)
def test_rope_store_kv_matches_unfused_kernels(target, num_q_heads, num_kv_heads, head_dim):
    num_tokens, block_size = 7, 8
    case = _make_case(target, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, 1)
    qkv, pool, positions, slots, cos_sin = case
    slots[3] = -1
    unfused_qkv, unfused_pool = qkv.clone(), pool.clone()
    q, k, v = _split_qkv(unfused_qkv, num_q_heads, num_kv_heads, head_dim)
    rope(q, k, positions, cos_sin)
    store_kv(k, v, unfused_pool[1, 0], unfused_pool[1, 1], slots)

    q, k, v = _split_qkv(qkv, num_q_heads, num_kv_heads, head_dim)
    rope_store_kv(q, k, v, positions, cos_sin, pool[1, 0], pool[1, 1], slots)
    # q and k rotated in place as the unfused rope does, v untouched: the whole buffer matches
    torch.testing.assert_close(qkv, unfused_qkv, rtol=0, atol=0)
    torch.testing.assert_close(pool, unfused_pool, rtol=0, atol=0)


def test_rope_store_kv_empty(target):
    cache = torch.zeros(2, 8, 1, 32, dtype=target.dtype, device=target.device)
    q = cache.new_zeros(0, 2, 32)
    k = cache.new_zeros(0, 1, 32)
    index = torch.zeros(0, dtype=torch.int64, device=cache.device)
    cos_sin = _cos_sin_cache(MAX_POS, 32).to(target.device)
    out = rope_store_kv(q, k, k, index, cos_sin, cache, cache.clone(), index)
    assert out is q


def test_rope_store_kv_rejects_int32_slot_mapping(target):
    qkv, pool, positions, slots, cos_sin = _make_case(target, 3, 4, 4, 32, 8)
    q, k, v = _split_qkv(qkv, 4, 4, 32)
    with pytest.raises(AssertionError):
        rope_store_kv(q, k, v, positions, cos_sin, pool[1, 0], pool[1, 1], slots.int())
