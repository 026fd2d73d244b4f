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

import torch
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
    # A uniform step (every sequence feeds ``max_query_len`` tokens) described again as more,
    # shorter sequences (``uniform_pieces``): the same rows, each piece of a sequence's tokens
    # a sequence of its own over the same context. The whole stays valid (the torch reference
    # reads it); a kernel backend may run the pieces on its short-query kernel, whose programs
    # split the context, where its prefill kernel would have a handful of programs each
    # walking the whole context (a drafter's catch-up chunk of 16-256 tokens over a long
    # prompt: 2-30 programs on a GPU of 132 SMs).
    pieces: AttentionMetadata | None = None

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
    sequence each) followed by prompt chunks (the rest). ``decode`` describes the first
    part; ``prompt`` the chunk, its ``query_start_loc`` counting rows of the whole step
    ([num_decode_rows, num_decode_rows + chunk rows]): its kernel reads the whole step's rows
    and writes only the chunk's."""

    decode: AttentionMetadata
    prompt: AttentionMetadata
    num_decode_rows: int


def split_decode_rows(
    meta: AttentionMetadata, n: int, decode_max_seq_len: int | None = None
) -> AttentionSplit:
    """``meta`` of ``n`` one-token rows (rows ``0 : n``, one sequence each) then prompt chunks,
    as its two parts: the rows for the split-K kernel, the chunks (their query starts counting
    the whole step's rows) for the prefill kernel. ``decode_max_seq_len``: the rows' longest
    context (default the step's). The chunks' tensors are copies: a slice at row ``n`` starts
    at an address Triton specializes on (16-byte aligned or not), and a kernel variant first
    met under traffic compiles for a second or more (a stall every step waits for)."""
    longest = meta.max_seq_len if decode_max_seq_len is None else decode_max_seq_len
    decode = AttentionMetadata(
        meta.slot_mapping[:n], meta.query_start_loc[: n + 1], meta.seq_lens[:n],
        meta.block_tables[:n], 1, longest,
    )  # fmt: skip
    prompt = AttentionMetadata(
        meta.slot_mapping[n:], meta.query_start_loc[n:].clone(), meta.seq_lens[n:].clone(),
        meta.block_tables[n:].clone(), meta.max_query_len, meta.max_seq_len,
    )  # fmt: skip
    return AttentionSplit(decode, prompt, n)


def uniform_pieces(meta: AttentionMetadata, piece: int) -> AttentionMetadata:
    """``meta`` of a uniform step (each of its B sequences feeds ``meta.max_query_len`` = q
    tokens, rows b*q .. (b+1)*q - 1) as B * ceil(q / piece) sequences of at most ``piece``
    tokens, in the same row order: piece k of sequence b is rows b*q + k*piece up to
    min(b*q + (k+1)*piece, (b+1)*q), over sequence b's blocks, its context ending at its last
    row. Built with device ops only (no host sync: inside a CUDA graph it reads the graph's
    static buffers at every replay)."""
    q, n = meta.max_query_len, meta.num_seqs
    per = -(-q // piece)
    idx = torch.arange(n * per, device=meta.seq_lens.device)
    b = idx // per
    start = b * q + (idx - b * per) * piece
    end = torch.minimum(start + piece, (b + 1) * q)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.cat([start, end[-1:]]).to(torch.int32),
        seq_lens=(meta.seq_lens.index_select(0, b) - ((b + 1) * q - end)).to(torch.int32),
        block_tables=meta.block_tables.index_select(0, b),
        max_query_len=min(piece, q),
        max_seq_len=meta.max_seq_len,
    )
