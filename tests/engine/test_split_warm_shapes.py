"""The split steps warmed at start-up (decode rows, then a prompt chunk) reach every launch of
the prefill kernel that a prompt part of any length can take: a shape left out compiles under
traffic, a stall of every lane (seen on an H200: a 9-16-token prompt part beside decode rows)."""

from __future__ import annotations

import pytest

from verifypd.engine.cuda_graphs import split_warm_shapes
from verifypd.kernels.triton_prefill_attention import (
    LONG_QUERY,
    default_prefill_tiles,
    launch_tiles,
)


def _launch(q: int, group: int, head_dim: int, block_size: int = 16):
    tiles = default_prefill_tiles(q, group, head_dim)
    return tiles.block_m, tiles.num_warps, launch_tiles(tiles, block_size)


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("max_len", [512, 4096])
def test_every_prompt_part_launch_is_warmed(group, head_dim, max_len):
    warmed = {_launch(q, group, head_dim) for _, q, _ in split_warm_shapes(max_len)}
    reachable = {_launch(q, group, head_dim) for q in range(1, max_len + 1)}
    assert reachable - warmed == set()


def test_the_long_prompt_launch_only_where_it_fits():
    assert max(q for _, q, _ in split_warm_shapes(LONG_QUERY - 1)) < LONG_QUERY
    assert max(q for _, q, _ in split_warm_shapes(LONG_QUERY)) == LONG_QUERY
    # the decode part: a row count == 1, one divisible by 16 and others, long and short contexts
    rows = {r for r, _, _ in split_warm_shapes(4096)}
    assert {1, 16} <= rows and rows - {1, 16}
    assert {c for _, _, c in split_warm_shapes(4096)} == {1, 4096}
