"""Attention metadata: where each new token's KV goes and what each query attends to.

Layout conventions shared by every attention op (torch reference and Triton):

- The new (query) tokens of all sequences are packed along one token axis ``T``; the tokens of
  sequence ``b`` are rows ``query_start_loc[b] : query_start_loc[b + 1]``.
- The query tokens of sequence ``b`` sit at positions ``seq_lens[b] - query_len_b ...
  seq_lens[b] - 1`` and attend causally to every earlier position of the same sequence.
- The KV of position ``p`` of sequence ``b`` lives in flat slot
  ``block_tables[b, p // block_size] * block_size + p % block_size`` of the layer's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class AttentionMetadata:
    """Per-step tensors describing a packed batch of query tokens over a paged KV cache."""

    slot_mapping: Tensor  # [T] int64: flat KV slot of each new token; < 0 = padding (skip)
    query_start_loc: Tensor  # [B+1] int32: cumulative query lengths
    seq_lens: Tensor  # [B] int32: context length including the new tokens
    block_tables: Tensor  # [B, max_blocks] int32, padded with 0 (never read past seq_len)
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] | None = None  # host copies for the torch reference path
    seq_lens_cpu: list[int] | None = None
    # A decode step carrying one prompt chunk (``EngineConfig.prompt_in_decode_tokens``): its
    # two parts' metadata. The whole stays valid (the torch reference reads it); a kernel
    # backend may run each part on its own kernel instead of one kernel over the whole.
    split: AttentionSplit | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence feeds exactly one new token."""
        return self.max_query_len == 1


@dataclass
class AttentionSplit:
    """A step of ``num_decode_rows`` one-token rows (rows ``0 : num_decode_rows``, one
    sequence each) followed by one sequence's chunk (the rest). ``decode`` describes the first
    part; ``prompt`` the chunk, its ``query_start_loc`` counting rows of the whole step
    ([num_decode_rows, num_decode_rows + chunk rows]): its kernel reads the whole step's rows
    and writes only the chunk's."""

    decode: AttentionMetadata
    prompt: AttentionMetadata
    num_decode_rows: int
