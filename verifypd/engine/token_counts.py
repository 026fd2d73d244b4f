"""Per-sequence token counts on the device, kept incrementally for the penalties.

``TokenCounts`` holds one row per sequence that uses a penalty: how often each token occurs in
its output ([V] float32) and which tokens its prompt holds ([V] bool). A step uploads only the
tokens each sequence gained since its last step (one scatter for the whole batch), never the
whole history. A sequence only ever gains tokens (rejected drafts never enter ``token_ids``),
so the counts never need rolling back. Rows of finished (or collected) sequences are reused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from verifypd.types import Sequence

_MIN_ROWS = 8


@dataclass
class _Row:
    index: int
    num_counted: int  # output tokens already in the row
    seq: weakref.ref


class TokenCounts:
    """Output-token counts [rows, V] and prompt-token sets [rows, V] of live sequences."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output = torch.zeros(0, vocab_size, device=device)  # [R, V] float32
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [R, V]
        self.rows: dict[int, _Row] = {}  # seq id -> row
        self._free: list[int] = []

    def rows_of(self, seqs: list[Sequence]) -> Tensor:
        """The rows of ``seqs`` ([B] int64 on the device), brought up to date with every
        output token the sequences hold now (row r of ``output`` / ``prompt``)."""
        self._release_finished()
        rows = [self.rows.get(s.seq_id) or self._assign(s) for s in seqs]
        new_rows, new_tokens = [], []
        for s, row in zip(seqs, rows, strict=True):
            fresh = s.token_ids[s.num_prompt_tokens + row.num_counted :]
            new_rows += [row.index] * len(fresh)
            new_tokens += fresh
            row.num_counted += len(fresh)
        if new_tokens:
            index = upload([new_rows, new_tokens], self.device)  # [2, N]
            ones = torch.ones(len(new_tokens), device=self.device)
            self.output.index_put_((index[0], index[1]), ones, accumulate=True)
        return upload([[r.index for r in rows]], self.device)[0]

    def _assign(self, seq: Sequence) -> _Row:
        if not self._free:
            self._grow()
        index = self._free.pop()
        self.output[index].zero_()
        self.prompt[index].zero_()
        if seq.params.repetition_penalty != 1.0:
            prompt = upload([seq.prompt_token_ids], self.device)[0]
            self.prompt[index].index_fill_(0, prompt, True)
        row = self.rows[seq.seq_id] = _Row(index, 0, weakref.ref(seq))
        return row

    def _grow(self) -> None:
        """Doubles the table. Steps on other streams may still read the old one: a device
        sync first (growth happens a handful of times in a server's life)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        old = self.output.shape[0]
        new = max(_MIN_ROWS, 2 * old)
        self.output = torch.cat([self.output, self.output.new_zeros(new - old, self.vocab_size)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab_size)])
        self._free += range(new - 1, old - 1, -1)

    def _release_finished(self) -> None:
        for seq_id, row in list(self.rows.items()):
            seq = row.seq()
            if seq is None or seq.status.is_finished:
                del self.rows[seq_id]
                self._free.append(row.index)


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """Host (nested) lists -> a tensor on ``device``: pinned and non-blocking on CUDA, so an
    upload never waits for the device."""
    pin = device.type == "cuda"
    host = torch.tensor(values, dtype=dtype, pin_memory=pin)
    return host.to(device, non_blocking=pin)
