"""Variable-length paged prefill / extend / verify attention vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_prefill_attention import prefill_attention

BATCHES = {
    # Mixed: a fresh prompt, a decode, a chunk after a cached prefix, a short extend.
    "mixed": ([7, 1, 20, 3], [7, 40, 45, 131]),
    # Verify-like: 1 + L tokens (L = 0..4) on long contexts.
    "verify": ([1, 2, 3, 4, 5], [150, 33, 64, 65, 257]),
    "prefill_only": ([13, 30], [13, 30]),
    "decode_only": ([1, 1, 1], [5, 70, 16]),
}


def _run_and_check(target, case, scale):
    out = torch.full_like(case.q, float("nan"))
    prefill_attention(case.q, case.k_cache, case.v_cache, case.meta, scale, out=out)
    ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, scale)
    assert not out.isnan().any(), "some output element was never written"
    torch.testing.assert_close(out.float(), ref.float(), rtol=target.rtol, atol=target.atol)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2), (14, 2)])
def test_prefill_batches_gqa(target, paged_case, batch, num_q_heads, num_kv_heads):
    query_lens, seq_lens = BATCHES[batch]
    case = paged_case(target, query_lens, seq_lens, num_q_heads, num_kv_heads, 32, block_size=8)
    _run_and_check(target, case, 0.17)


@pytest.mark.parametrize("block_size,head_dim", [(4, 32), (16, 64)])
def test_prefill_block_sizes(target, paged_case, block_size, head_dim):
    case = paged_case(target, [3, 17, 1], [3, 90, 41], 8, 2, head_dim, block_size, seed=1)
    _run_and_check(target, case, head_dim**-0.5)


def test_prefill_long_query_spans_several_row_tiles(target, paged_case):
    # 150 query tokens x G=2 rows need several 128-row tiles; a cached prefix of 37 tokens.
    case = paged_case(target, [150, 2], [187, 9], 4, 2, 32, block_size=16, seed=2)
    _run_and_check(target, case, 0.2)


def test_prefill_reads_only_this_layer(target, paged_case):
    case = paged_case(target, [4, 9], [40, 9], 4, 2, 32, block_size=8, seed=3)
    expected = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    case.pool[0].fill_(float("nan"))
    out = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _new_token_kv(case, num_q_heads):
    """The new tokens' k and v as the model hands them over: strided views of one fused qkv
    buffer [T, (Hq + 2 Hkv) D], holding what the cache holds at their slots."""
    flat_k = case.k_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
    flat_v = case.v_cache.flatten(0, 1)
    num_tokens, (num_kv_heads, head_dim) = case.q.shape[0], flat_k.shape[1:]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.zeros(num_tokens, width, dtype=case.q.dtype, device=case.q.device)
    k_new = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim]
    v_new = qkv[:, (num_q_heads + num_kv_heads) * head_dim :]
    k_new, v_new = (x.view(num_tokens, num_kv_heads, head_dim) for x in (k_new, v_new))
    k_new.copy_(flat_k[case.meta.slot_mapping])
    v_new.copy_(flat_v[case.meta.slot_mapping])
    return k_new, v_new


def _check_reads_new_tokens_from_k_new(target, case, num_q_heads, scale):
    ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, scale)
    k_new, v_new = _new_token_kv(case, num_q_heads)
    # The new tokens' cache slots poisoned: only the prefix may come from the pages.
    for cache in (case.k_cache, case.v_cache):
        cache.flatten(0, 1)[case.meta.slot_mapping] = float("nan")
    out = torch.full_like(case.q, float("nan"))
    prefill_attention(
        case.q, case.k_cache, case.v_cache, case.meta, scale, k_new=k_new, v_new=v_new, out=out
    )
    assert not out.isnan().any(), "a new token's key or value came from the cache"
    torch.testing.assert_close(out.float(), ref.float(), rtol=target.rtol, atol=target.atol)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 4), (14, 2)])
def test_prefill_new_tokens_from_their_own_rows(
    target, paged_case, batch, num_q_heads, num_kv_heads
):
    query_lens, seq_lens = BATCHES[batch]
    case = paged_case(target, query_lens, seq_lens, num_q_heads, num_kv_heads, 32, block_size=8)
    _check_reads_new_tokens_from_k_new(target, case, num_q_heads, 0.17)


def test_prefill_new_tokens_long_and_short_with_prefixes(target, paged_case):
    # 150 new tokens after a 37-token prefix (several row tiles, key tiles and pages), a short
    # prompt with no prefix, a 70-token prompt whose prefix ends mid-page: the short ones have
    # empty row tiles, which run first (the grid goes last tile first).
    case = paged_case(target, [150, 2, 70], [187, 2, 75], 14, 2, 32, block_size=16, seed=4)
    _check_reads_new_tokens_from_k_new(target, case, 14, 0.2)


def test_prefill_k_new_and_v_new_come_together(target, paged_case):
    case = paged_case(target, [5], [9], 4, 2, 32, block_size=8)
    k_new, _ = _new_token_kv(case, 4)
    with pytest.raises(AssertionError, match="together"):
        prefill_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2, k_new=k_new)


@pytest.mark.parametrize("block_size", [16, 8, 128])
def test_prefill_new_tokens_after_long_prefixes(target, paged_case, block_size):
    # Prefixes of 300 (two whole 128-key prefix tiles and a partial one), 129 (one and one key)
    # and 256 tokens (two, no partial tile): the prefix loop's block ids loaded a tile ahead.
    case = paged_case(target, [20, 3, 70], [320, 132, 326], 14, 2, 32, block_size, seed=5)
    _check_reads_new_tokens_from_k_new(target, case, 14, 0.2)


def test_launch_tiles_keep_shared_memory_bounded():
    from verifypd.kernels.triton_prefill_attention import (
        LONG_QUERY,
        PrefillTiles,
        default_prefill_tiles,
        launch_tiles,
    )

    long, short = default_prefill_tiles(LONG_QUERY, 7, 128), default_prefill_tiles(512, 7, 128)
    assert (long.num_stages, short.num_stages) == (3, 2)
    assert launch_tiles(long, 16) == (64, 128, 3)  # the prefix in tiles of twice the keys
    assert launch_tiles(short, 16) == (64, 128, 2)
    # KV blocks of 128 tokens: the tiles follow them, no longer prefix tiles, two stages
    assert launch_tiles(long, 128) == (128, 128, 2)
    assert launch_tiles(default_prefill_tiles(LONG_QUERY, 2, 256), 16) == (32, 64, 3)
    assert launch_tiles(PrefillTiles(128, 128, 8, 4), 16) == (128, 128, 2)
