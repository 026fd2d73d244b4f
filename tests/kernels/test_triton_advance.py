"""The one-launch input advance of the drafter's graph steps vs the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels.triton_advance import (
    advance,
    advance_reference,
    chain_inputs,
    chain_inputs_reference,
)


@pytest.mark.parametrize("num_rows", [1, 3, 17, 300])
def test_advance_matches_the_torch_ops(target, num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    block_size, width, padded = 16, 9, num_rows + 5  # buffers are longer than the batch
    positions = torch.randint(0, block_size * (width - 1) - 1, (padded,), generator=gen)
    bufs = {
        "input_ids": torch.randint(0, 1000, (padded,), generator=gen),
        "positions": positions,
        "seq_lens": (positions + 1).to(torch.int32),
        "block_tables": torch.randint(0, 500, (padded, width), generator=gen, dtype=torch.int32),
        "slots": torch.full((padded,), -1, dtype=torch.int64),
    }
    next_ids = torch.randint(0, 1000, (num_rows,), generator=gen)
    want = {k: v.clone() for k, v in bufs.items()}
    advance_reference(next_ids, *want.values(), block_size)
    got = {k: v.clone().to(target.device) for k, v in bufs.items()}
    advance(next_ids.to(target.device), *got.values(), block_size)
    for name in bufs:
        assert torch.equal(got[name].cpu(), want[name]), name
    assert torch.equal(want["slots"][num_rows:], bufs["slots"][num_rows:])  # padding untouched
    assert torch.equal(want["positions"][:num_rows], positions[:num_rows] + 1)


@pytest.mark.parametrize("num_rows,num_padded", [(1, 1), (3, 4), (5, 8), (300, 300)])
def test_chain_inputs_match_the_torch_ops(target, num_rows, num_padded):
    gen = torch.Generator().manual_seed(num_rows)
    block_size, width, num_drafts, vocab = 16, 6, 4, 900
    num_verified = num_rows + 2
    verify_ids = torch.randint(0, 1000, (num_verified * (num_drafts + 1),), generator=gen)
    out = torch.randint(0, 1000, (num_verified, num_drafts + 1), generator=gen)
    num_accepted = torch.randint(0, num_drafts + 1, (num_verified,), generator=gen)
    vrows = torch.randperm(num_verified, generator=gen)[:num_rows]
    base = torch.randint(0, block_size * (width - 1) - num_drafts - 2, (num_rows,), generator=gen)
    rows = torch.stack([vrows, vrows * (num_drafts + 1), base])
    tables = torch.randint(0, 500, (num_rows, width), generator=gen, dtype=torch.int32)
    n = 2 * num_padded + 3  # graph buffers are longer than the batch
    step = [torch.full((n,), 7), torch.full((n,), 7), torch.full((n,), 7),
            torch.full((n,), 7, dtype=torch.int32)]  # fmt: skip
    next_step = [torch.full((n,), 7), torch.full((n,), 7, dtype=torch.int32)]
    want_step, want_next = [t.clone() for t in step], [t.clone() for t in next_step]
    args = (rows, num_accepted, verify_ids, out, tables)
    chain_inputs_reference(*args, want_step, want_next, num_padded, vocab, block_size)
    dev = [t.to(target.device) for t in args]
    got_step, got_next = (
        [t.to(target.device) for t in step],
        [t.to(target.device) for t in next_step],
    )
    chain_inputs(*dev, got_step, got_next, num_padded, vocab, block_size)
    for name, got, want in zip(["ids", "positions", "slots", "seq_lens", "next positions",
                                "next seq_lens"], got_step + got_next, want_step + want_next,
                               strict=True):  # fmt: skip
        assert torch.equal(got.cpu(), want), name
    k = num_accepted[vrows]
    assert torch.equal(want_step[1][: 2 * num_rows : 2], base + k)  # the token before the final
    assert (want_step[2][2 * num_padded :] == 7).all()  # nothing past the padded batch
