"""qkv_rope_store (Triton: one token's q/k/v GEMV with RoPE and the KV store in its epilogue)
against the two-step reference: the projection, then ``rope_store_kv``."""

from __future__ import annotations

import pytest
import torch
from test_triton_rope_store import _cos_sin_cache

from verifypd.config import KernelConfig
from verifypd.kernels import reference, triton_ops, triton_qkv_rope
from verifypd.kernels.triton_qkv_rope import qkv_rope_store

NUM_BLOCKS, MAX_POS = 5, 50


def _case(target, num_q_heads, num_kv_heads, head_dim, hidden, block_size, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(target.dtype).to(target.device)

    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    x, weight, bias = rand(1, hidden, scale=3.0), rand(n, hidden, scale=0.1), rand(n)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(target.dtype)
    pool = rand(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    position = torch.randint(0, MAX_POS, (1,), generator=gen).to(target.device)
    slot = torch.randint(0, NUM_BLOCKS * block_size, (1,), generator=gen).to(target.device)
    cos_sin = _cos_sin_cache(MAX_POS, head_dim).to(target.device)
    return x, norm_weight.to(target.device), weight, bias, pool, position, slot, cos_sin


def _two_steps(x, norm_weight, weight, bias, heads, position, cos_sin, pool, slot):
    """The reference: the projection (norm and bias folded or not), then rope_store_kv."""
    num_q_heads, num_kv_heads, head_dim = heads
    if norm_weight is None:
        qkv = reference.linear(x, weight, bias)
    else:
        qkv = reference.rms_norm_linear(x, norm_weight, 1e-6, weight, bias)
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(1, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(1, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(1, num_kv_heads, head_dim)
    q_rot = reference.rope_store_kv(q, k, v, position, cos_sin, pool[0], pool[1], slot)
    return torch.cat((q_rot.reshape(1, -1), qkv[:, q_end:]), dim=1)  # k rotated in place


@pytest.mark.parametrize("prefetch", ["off", "all"])
@pytest.mark.parametrize("with_norm,with_bias", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,hidden",
    [(4, 2, 32, 96), (7, 1, 64, 1030), (2, 2, 8, 40), (2, 1, 10, 40)],  # D / 2 = 5: a pair each
)
def test_matches_projection_then_rope_store(
    target, num_q_heads, num_kv_heads, head_dim, hidden, with_norm, with_bias, prefetch
):
    heads = (num_q_heads, num_kv_heads, head_dim)
    case = _case(target, *heads, hidden, block_size=8, seed=hidden + head_dim)
    x, norm_weight, weight, bias, pool, position, slot, cos_sin = case
    norm_weight = norm_weight if with_norm else None
    bias = bias if with_bias else None
    original, expected_pool = pool.clone(), pool.clone()
    expected = _two_steps(x, norm_weight, weight, bias, heads, position, cos_sin,
                          expected_pool, slot)  # fmt: skip

    out = qkv_rope_store(x, norm_weight, 1e-6, weight, bias, num_q_heads, num_kv_heads,
                         position, cos_sin, pool[0], pool[1], slot, prefetch=prefetch)  # fmt: skip

    torch.testing.assert_close(out, expected, rtol=target.rtol, atol=target.atol * 4)
    torch.testing.assert_close(pool, expected_pool, rtol=target.rtol, atol=target.atol * 4)
    block, offset = divmod(int(slot), pool.shape[2])
    assert not torch.equal(pool[:, block, offset], original[:, block, offset])  # it was written


def test_padding_slot_leaves_the_cache(target):
    case = _case(target, 4, 2, 16, 64, block_size=16, seed=3)
    x, norm_weight, weight, bias, pool, position, _, cos_sin = case
    before = pool.clone()
    padding = torch.tensor([-1], dtype=torch.int64, device=pool.device)

    out = qkv_rope_store(x, norm_weight, 1e-6, weight, bias, 4, 2, position, cos_sin,
                         pool[0], pool[1], padding)  # fmt: skip

    assert torch.equal(pool, before)
    expected = _two_steps(x, norm_weight, weight, bias, (4, 2, 16), position, cos_sin,
                          before.clone(), padding)  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=target.rtol, atol=target.atol * 4)


def test_rejects_more_than_one_token(target):
    case = _case(target, 2, 1, 8, 32, block_size=8, seed=1)
    x, norm_weight, weight, bias, pool, position, slot, cos_sin = case
    with pytest.raises(AssertionError, match="x: "):
        qkv_rope_store(x.expand(2, -1).contiguous(), norm_weight, 1e-6, weight, bias, 2, 1,
                       position, cos_sin, pool[0], pool[1], slot)  # fmt: skip


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_ops_fuse_one_token_under_the_knob(target, fused, num_tokens, monkeypatch):
    """``TritonOps.qkv_rope_store``: one kernel for one token when ``fuse_rope_store`` is on,
    the projection then ``rope_store_kv`` otherwise; the reference's q, k, v and cache either
    way."""
    calls: list[int] = []
    kernel = triton_qkv_rope.qkv_rope_store

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(triton_qkv_rope, "qkv_rope_store", spy)
    ops = triton_ops.TritonOps(KernelConfig(fuse_rope_store=fused))
    heads = (4, 2, 16)
    x, norm_weight, weight, bias, pool, _, _, cos_sin = _case(target, *heads, 64, 8, seed=5)
    scales = torch.arange(1, num_tokens + 1, device=x.device)[:, None].to(x.dtype)
    x = x.expand(num_tokens, -1) * scales  # distinct rows
    positions = torch.arange(3, 3 + num_tokens, device=x.device)
    slots = torch.tensor([9, -1, 30][:num_tokens], device=x.device)
    expected_pool = pool.clone()
    expected = reference.qkv_rope_store(
        x, norm_weight, 1e-6, weight, bias, *heads[:2], positions, cos_sin,
        expected_pool[0], expected_pool[1], slots,
    )  # fmt: skip

    got = ops.qkv_rope_store(x, norm_weight, 1e-6, weight, bias, *heads[:2], positions, cos_sin,
                             pool[0], pool[1], slots)  # fmt: skip

    assert calls == ([1] if fused and num_tokens == 1 else [])
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=target.rtol, atol=target.atol * 4)
    torch.testing.assert_close(pool, expected_pool, rtol=target.rtol, atol=target.atol * 4)
