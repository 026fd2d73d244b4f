"""Torch reference ops vs naive dense per-sequence implementations (and transformers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from verifypd.engine.rope import build_cos_sin_cache
from verifypd.kernels import get_ops, reference
from verifypd.kernels.metadata import AttentionMetadata

BLOCK_SIZE = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _block_tables(seq_lens: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Non-contiguous tables: blocks 1.. handed out in a shuffled order (0 stays unused)."""
    free = (torch.randperm(num_blocks - 1, generator=_gen(seed)) + 1).tolist()
    return [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]


def _metadata(
    tables: list[list[int]], seq_lens: list[int], query_lens: list[int], host_lens: bool = True
) -> AttentionMetadata:
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for table, n, q in zip(tables, seq_lens, query_lens, strict=True)
        for p in range(n - q, n)
    ]
    width = max(len(t) for t in tables)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens if host_lens else None,
        seq_lens_cpu=seq_lens if host_lens else None,
    )


def _dense_keys(cache: torch.Tensor, table: list[int], seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D], read slot by slot."""
    rows = [cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in range(seq_len)]
    return torch.stack(rows)


def _naive_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, scale) -> torch.Tensor:
    """Per sequence: dense causal SDPA in fp64 with KV heads repeated for GQA."""
    outs, start = [], 0
    group = q.shape[1] // k_cache.shape[2]
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        if q_len == 0:
            continue
        qs = q[start : start + q_len].double().transpose(0, 1)  # [Hq, L, D]
        k = _dense_keys(k_cache, table, seq_len).double().repeat_interleave(group, 1)
        v = _dense_keys(v_cache, table, seq_len).double().repeat_interleave(group, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos  # [L, S]
        out = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        outs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def _filled_caches(tables, seq_lens, num_kv_heads, head_dim, num_blocks, seed):
    """Caches holding random KV at every written position and NaN everywhere else."""
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    g = _gen(seed)
    for table, n in zip(tables, seq_lens, strict=True):
        for p in range(n):
            k_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(shape[2:], generator=g)
            v_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(shape[2:], generator=g)
    return k_cache, v_cache


BATCHES = {
    "prefill": ([7, 13, 1, 10], [7, 13, 1, 10]),
    "decode": ([9, 1, 17, 6], [1, 1, 1, 1]),
    "mixed": ([11, 5, 22, 8], [4, 1, 9, 8]),  # chunked prefill + decode + extend
}


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    "attention",
    [reference.paged_attention, reference.attention_padded, reference.attention_per_seq],
)
def test_paged_attention_matches_dense(group, batch, attention):
    seq_lens, query_lens = BATCHES[batch]
    num_kv_heads, head_dim, num_blocks = 2, 16, 32
    tables = _block_tables(seq_lens, num_blocks, seed=group)
    k_cache, v_cache = _filled_caches(tables, seq_lens, num_kv_heads, head_dim, num_blocks, 0)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=_gen(1))
    meta = _metadata(tables, seq_lens, query_lens, host_lens=group % 2 == 0)

    out = attention(q, k_cache, v_cache, meta, head_dim**-0.5)

    expected = _naive_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_keeps_dtype_and_ignores_padding_seq():
    """bf16 in, bf16 out; a padding sequence (no query, seq_len 0) changes nothing."""
    seq_lens, query_lens = [6, 0, 3], [2, 0, 1]
    tables = _block_tables(seq_lens, 8, seed=3)
    k_cache, v_cache = _filled_caches(tables, seq_lens, 1, 8, 8, 0)
    q = torch.randn(3, 2, 8, generator=_gen(2))
    meta = _metadata(tables, seq_lens, query_lens)

    out = reference.paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.3)

    expected = _naive_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_store_kv_writes_slots_and_skips_padding():
    num_blocks, num_kv_heads, head_dim = 5, 2, 4
    k = torch.randn(6, num_kv_heads, head_dim, generator=_gen(0))
    v = torch.randn(6, num_kv_heads, head_dim, generator=_gen(1))
    slots = torch.tensor([13, -1, 2, 19, -1, 0])
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)

    reference.store_kv(k, v, k_cache, v_cache, slots)

    k_expected, v_expected = torch.zeros(shape), torch.zeros(shape)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]
            v_expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_transformers(dtype, with_residual):
    x = torch.randn(5, 32, generator=_gen(0)).to(dtype)
    residual = torch.randn(5, 32, generator=_gen(1)).to(dtype) if with_residual else None
    hf_norm = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + 0.1 * torch.randn(32, generator=_gen(2)))

    out, new_residual = reference.rms_norm(x, hf_norm.weight.to(dtype), 1e-5, residual)

    summed = x + residual if with_residual else x
    assert torch.equal(new_residual, summed) and out.dtype == dtype
    with torch.no_grad():
        expected = hf_norm.float()(summed.float())
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_rope_matches_transformers_apply_rotary_pos_emb():
    head_dim, num_tokens = 16, 9
    cache = build_cos_sin_cache(head_dim, 10000.0, None, 64)
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 7, 63, 5])
    q = torch.randn(num_tokens, 4, head_dim, generator=_gen(0))
    k = torch.randn(num_tokens, 2, head_dim, generator=_gen(1))

    q_out, k_out = reference.rope(q, k, positions, cache)

    freqs = torch.outer(positions.float(), 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16))
    emb = torch.cat((freqs, freqs), dim=-1)  # HF layout: [T, D]
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_silu_and_mul():
    x = torch.randn(3, 2 * 10, generator=_gen(0))
    expected = torch.stack([F.silu(row[:10]) * row[10:] for row in x])
    torch.testing.assert_close(reference.silu_and_mul(x), expected)


def test_get_ops_reference_table():
    ops = get_ops()
    assert ops.paged_attention is reference.paged_attention
    assert ops.store_kv is reference.store_kv
