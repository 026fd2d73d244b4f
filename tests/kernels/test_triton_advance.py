"""The one-launch input advance of the drafter's graph steps vs the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels.triton_advance import advance, advance_reference


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
