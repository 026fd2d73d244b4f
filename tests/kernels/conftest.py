"""Shared setup for the Triton kernel tests.

Without a GPU the kernels run on Triton's interpreter (CPU tensors, fp32, tight tolerances);
with one they run compiled on CUDA in bf16 with bf16 tolerances. TRITON_INTERPRET must be set
before the first ``@triton.jit`` decorator runs, i.e. before any kernel module is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from verifypd.kernels.metadata import AttentionMetadata  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Target:
    device: str
    dtype: torch.dtype
    rtol: float
    atol: float


TARGETS = [
    pytest.param(
        Target("cpu", torch.float32, rtol=1e-4, atol=1e-5),
        id="interp-fp32",
        marks=pytest.mark.skipif(not INTERPRET, reason="CPU run needs TRITON_INTERPRET=1"),
    ),
    pytest.param(
        Target("cuda", torch.bfloat16, rtol=2e-2, atol=2e-2),
        id="cuda-bf16",
        marks=pytest.mark.skipif(
            INTERPRET or not torch.cuda.is_available(),
            reason="no GPU (or TRITON_INTERPRET=1): compiled kernels need CUDA",
        ),
    ),
]


@pytest.fixture(params=TARGETS)
def target(request) -> Target:
    return request.param


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], a view into a 2-layer pool
    v_cache: torch.Tensor
    pool: torch.Tensor  # [num_layers, 2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata


def make_paged_case(
    target: Target,
    query_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
) -> PagedCase:
    """Random q and a random KV pool; each sequence's blocks are a shuffled set of block ids."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).int()
    block_tables = torch.zeros(num_seqs, max(blocks_per_seq) + 2, dtype=torch.int32)
    slots, used = [], 0
    lens = zip(blocks_per_seq, query_lens, seq_lens, strict=True)
    for b, (n_blocks, q_len, s_len) in enumerate(lens):
        block_tables[b, :n_blocks] = perm[used : used + n_blocks]
        used += n_blocks
        for p in range(s_len - q_len, s_len):
            slots.append(int(block_tables[b, p // block_size]) * block_size + p % block_size)
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=gen).to(target.dtype)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen).to(target.dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    dev = target.device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=query_start_loc.to(torch.int32).to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    pool = pool.to(dev)
    return PagedCase(q.to(dev), pool[1, 0], pool[1, 1], pool, meta)


@pytest.fixture
def paged_case():
    return make_paged_case
