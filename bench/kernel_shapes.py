"""``bench/kernels.py``'s shapes (Qwen2.5-7B's on the GPU, tiny ones for the interpreter),
the tile shapes it sweeps, and the fewest bytes and the FLOPs of an attention call."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shapes:
    """Model and sweep shapes: Qwen2.5-7B on the GPU, tiny ones for the interpreter."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    inter: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    headline: tuple[int, int]  # (batch, context)
    split_sweep: tuple[int, ...]
    split_sweep_cases: tuple[tuple[int, int, int], ...]  # (batch, query len, context)
    verify_cases: tuple[tuple[int, int, int], ...]  # (batch, 1 + L, context): split-K kernel
    verify_tile_case: tuple[int, int, int]  # swept over the decode tile shapes
    prefill_cases: tuple[tuple[str, int, int, int], ...]  # (name, batch, query len, context)
    token_counts: tuple[int, ...]


GPU_SHAPES = Shapes(
    28, 4, 128, 16, 3584, 18944,
    decode_batches=(1, 8, 32, 64), decode_contexts=(512, 1024, 2048, 4096, 8192),
    headline=(64, 2048), split_sweep=(1, 2, 4, 8, 16, 32),
    split_sweep_cases=(
        (64, 1, 2048), (8, 1, 2048), (1, 1, 2048), (1, 1, 8192), (8, 1, 8192), (8, 5, 8192),
        (32, 5, 2048), (64, 5, 2048),
    ),
    verify_cases=((1, 5, 2048), (8, 5, 8192), (32, 5, 2048), (64, 5, 2048), (64, 9, 2048)),
    verify_tile_case=(32, 5, 2048),
    prefill_cases=(
        ("prefill", 1, 2048, 2048), ("prefill", 4, 512, 2048), ("chunk", 2, 1024, 4096),
        ("extend", 16, 32, 2048),
        # verify shapes through the prefill kernel, to compare with the split-K path
        ("verify_via_prefill", 8, 5, 8192), ("verify_via_prefill", 32, 5, 2048),
        ("verify_via_prefill", 64, 5, 2048),
    ),
    token_counts=(64, 8192),
)  # fmt: skip
DRY_SHAPES = Shapes(
    14, 2, 32, 8, 64, 96,
    decode_batches=(1, 3), decode_contexts=(40, 100), headline=(3, 100), split_sweep=(1, 3),
    split_sweep_cases=((3, 1, 100), (2, 4, 60)),
    verify_cases=((3, 5, 60),),
    verify_tile_case=(3, 5, 60),
    prefill_cases=(("prefill", 1, 24, 24), ("extend", 2, 12, 40), ("verify_via_prefill", 3, 5, 60)),
    token_counts=(4,),
)  # fmt: skip
DECODE_TILE_SWEEP = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2))
PREFILL_TILE_SWEEP = (
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
    (64, 128, 4, 2), (128, 32, 4, 3),
)  # fmt: skip


def attention_bytes(s: Shapes, batch: int, query_len: int, context: int, elem: int) -> int:
    kv = 2 * batch * context * s.num_kv_heads * s.head_dim * elem
    q_and_out = 2 * batch * query_len * s.num_q_heads * s.head_dim * elem
    return kv + q_and_out + batch * (-(-context // s.block_size)) * 4


def attention_flops(s: Shapes, batch: int, query_len: int, context: int) -> int:
    visible = sum(context - query_len + i + 1 for i in range(query_len))  # causal key counts
    return 4 * batch * visible * s.num_q_heads * s.head_dim
