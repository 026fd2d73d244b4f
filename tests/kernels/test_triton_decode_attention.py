"""Split-K paged attention for short queries (decode, verify) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_decode_attention import (
    DecodeTiles,
    choose_num_splits,
    decode_attention,
    is_short_query,
)


def _run_and_check(target, case, scale, **kwargs):
    """Run into a NaN-poisoned output, so an unwritten element fails the comparison."""
    out = torch.full_like(case.q, float("nan"))
    decode_attention(case.q, case.k_cache, case.v_cache, case.meta, scale, out=out, **kwargs)
    ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=target.rtol, atol=target.atol)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gqa_and_splits(target, paged_case, num_q_heads, num_kv_heads, num_splits):
    # Lengths that do not divide the block size; the 300-token context spans several splits.
    case = paged_case(target, [1] * 4, [5, 37, 300, 64], num_q_heads, num_kv_heads, 32, 8)
    _run_and_check(target, case, 0.17, num_splits=num_splits)


@pytest.mark.parametrize("block_size,head_dim", [(4, 32), (16, 64)])
def test_decode_block_sizes(target, paged_case, block_size, head_dim):
    case = paged_case(target, [1] * 3, [1, 19, 129], 8, 2, head_dim, block_size, seed=1)
    _run_and_check(target, case, head_dim**-0.5, num_splits=2)


def test_decode_many_splits_short_seqs(target, paged_case):
    # More splits than a short sequence has key tiles: the empty splits must drop out.
    case = paged_case(target, [1] * 3, [2, 70, 513], 4, 1, 32, block_size=16, seed=2)
    _run_and_check(target, case, 0.2, num_splits=8, tiles=DecodeTiles(block_n=32))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (14, 2), (16, 2)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_verify_batch(target, paged_case, num_q_heads, num_kv_heads, num_splits):
    # 1 + L query tokens on long contexts. With 4 splits the last chunk of the 65-token
    # sequence holds only key 64, visible to its last query token alone.
    query_lens, seq_lens = [1, 2, 3, 4, 5], [150, 33, 64, 257, 65]
    case = paged_case(target, query_lens, seq_lens, num_q_heads, num_kv_heads, 32, 8, seed=5)
    _run_and_check(target, case, 0.17, num_splits=num_splits, tiles=DecodeTiles(block_n=16))


def test_decode_skips_padding_sequence(target, paged_case):
    # A CUDA-graph style padding entry (no query token, empty context) writes nothing.
    case = paged_case(target, [1, 1, 0], [40, 9, 0], 8, 2, 32, block_size=8, seed=4)
    for num_splits in (1, 2):
        out = torch.full_like(case.q, float("nan"))
        meta, scale = case.meta, 0.3
        decode_attention(
            case.q, case.k_cache, case.v_cache, meta, scale, num_splits=num_splits, out=out
        )
        ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, meta, scale)
        torch.testing.assert_close(out, ref, rtol=target.rtol, atol=target.atol)


def test_decode_reads_only_this_layer(target, paged_case):
    case = paged_case(target, [1, 1], [40, 9], 4, 2, 32, block_size=8, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    expected = decode_attention(*args, num_splits=2)
    case.pool[0].fill_(float("nan"))  # other layers' K/V must not leak in
    torch.testing.assert_close(decode_attention(*args, num_splits=2), expected, rtol=0, atol=0)


def test_padding_token_rows_are_not_written(target, paged_case):
    case = paged_case(target, [2, 1], [30, 9], 8, 2, 32, block_size=8, seed=6)
    q = torch.cat([case.q, case.q[:2]])  # two padding token rows past query_start_loc[B]
    for num_splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(
            q, case.k_cache, case.v_cache, case.meta, 0.3, num_splits=num_splits, out=out
        )
        assert out[:3].isfinite().all() and out[3:].isnan().all()


def test_short_query_limit():
    assert is_short_query(9, 28, 4) and not is_short_query(10, 28, 4)
    assert is_short_query(1, 64, 1) and not is_short_query(2, 64, 1)


def test_num_splits_heuristic():
    cpu = torch.device("cpu")  # 16 "SMs" off-GPU: 64 programs for decode, 32 for verify
    assert choose_num_splits(64, 4, 2048, 16, cpu) == 1  # 256 programs already
    assert choose_num_splits(8, 4, 2048, 16, cpu) == 2
    assert choose_num_splits(8, 4, 2048, 64, cpu) == 1
    assert choose_num_splits(1, 4, 2048, 16, cpu) == 16
    assert choose_num_splits(1, 1, 300, 16, cpu) == 5  # capped by 64-token chunks
    assert choose_num_splits(1, 1, 100_000, 16, cpu) == 32  # capped by MAX_SPLITS
    assert choose_num_splits(1, 1, 0, 16, cpu) == 1
