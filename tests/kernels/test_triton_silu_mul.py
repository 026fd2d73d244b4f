"""silu_and_mul (Triton) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from verifypd.kernels import reference
from verifypd.kernels.triton_silu_mul import silu_and_mul


@pytest.mark.parametrize("num_tokens,inter_size", [(3, 96), (2, 1500), (1, 8)])
def test_silu_and_mul(target, num_tokens, inter_size):
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(num_tokens, 2 * inter_size, generator=gen)
    x = x.to(target.dtype).to(target.device)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, inter_size) and out.dtype == x.dtype
    torch.testing.assert_close(out, reference.silu_and_mul(x), rtol=target.rtol, atol=target.atol)
