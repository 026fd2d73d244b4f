"""Runner-independent helpers: drive a DecoderLM over a paged KV pool in tests.

A ``PagedSeq`` owns its tokens, block table and progress; ``forward_step`` packs a chunk of
each sequence into one batch, builds the ``AttentionMetadata`` and returns per-sequence logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verifypd.config import ModelConfig
from verifypd.engine.model import DecoderLM
from verifypd.kernels.metadata import AttentionMetadata


@dataclass
class PagedSeq:
    token_ids: list[int]
    block_table: list[int]
    num_computed: int = 0


def build_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for feeding ``num_new[b]`` tokens after ``num_computed[b]`` cached ones."""
    seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, start, end in zip(block_tables, num_computed, seq_lens, strict=True)
        for p in range(start, end)
    ]
    max_blocks = max(len(t) for t in block_tables)
    tables = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    query_start = [0]
    for n in num_new:
        query_start.append(query_start[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(num_new),
        seq_lens_cpu=seq_lens,
    )


def new_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=torch.float32) -> Tensor:
    """[num_layers, 2, num_blocks, block_size, Hkv, D], filled with NaN so that reading a slot
    that was never written poisons the output instead of passing silently."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.full(shape, float("nan"), dtype=dtype)


@torch.inference_mode()
def forward_step(
    model: DecoderLM, kv: Tensor, seqs: list[PagedSeq], num_new: list[int]
) -> list[Tensor]:
    """Feed the next ``num_new[b]`` tokens of each sequence; returns logits [num_new_b, V] each
    and advances ``num_computed``."""
    block_size = kv.shape[3]
    ids, positions = [], []
    for seq, n in zip(seqs, num_new, strict=True):
        ids += seq.token_ids[seq.num_computed : seq.num_computed + n]
        positions += range(seq.num_computed, seq.num_computed + n)
    meta = build_metadata(
        [s.block_table for s in seqs], [s.num_computed for s in seqs], num_new, block_size
    )
    hidden = model(torch.tensor(ids), torch.tensor(positions), kv, meta)
    logits = model.compute_logits(hidden).split(num_new)
    for seq, n in zip(seqs, num_new, strict=True):
        seq.num_computed += n
    return list(logits)
