"""The counter-based sampling noise as Triton kernels (``kernels.triton_noise_race``) against
the torch int64 reference (``sampler.uniform_noise_torch``, ``sampler.exponential_race``): the
same uniforms bit for bit, the same draws."""

from __future__ import annotations

import pytest
import torch

from verifypd.engine import sampler
from verifypd.kernels import triton_noise_race


@pytest.fixture(autouse=True)
def _fused(monkeypatch):
    """``KernelConfig.fused_sampling_noise`` on: the sampler's entry points take the kernels
    on a GPU (torch ops on CPU tensors either way)."""
    monkeypatch.setattr(sampler, "_fused_noise", True)


def _rows(target, n, seed):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    seeds[0] = -1  # all bits set: the hash's wraparound
    positions = torch.randint(0, 10**7, (n,), generator=gen)
    return seeds.to(target.device), positions.to(target.device), gen


@pytest.mark.parametrize("n,num_cols", [(1, 1), (3, 5), (2, 2048), (4, 5000)])
@pytest.mark.parametrize("stream", [0, 1, 2, 3])
def test_uniforms_are_the_reference_bits(target, n, num_cols, stream):
    seeds, positions, _ = _rows(target, n, seed=n * num_cols + stream)
    got = triton_noise_race.uniform_noise(seeds, positions, num_cols, stream)
    expected = sampler.uniform_noise_torch(seeds, positions, num_cols, stream)
    assert got.dtype == torch.float32 and got.shape == (n, num_cols)
    assert torch.equal(got, expected)
    assert torch.equal(sampler.uniform_noise(seeds, positions, num_cols, stream), expected)


@pytest.mark.parametrize("n,vocab", [(1, 7), (3, 2048), (2, 4097), (5, 3000)])
@pytest.mark.parametrize("stream", [0, 2])
def test_race_draws_what_the_reference_draws(target, n, vocab, stream):
    seeds, positions, gen = _rows(target, n, seed=vocab + stream)
    probs = torch.rand(n, vocab, generator=gen)
    probs[0, : vocab // 2] = 0.0  # zeros are never drawn
    if n > 2:
        probs[2] = 0.0  # an all-zero row: index 0, as torch's argmax (ties across chunks)
    if n == 2:
        probs[1, :-1] = 0.0  # the mass only in the row's last column (its last chunk)
    probs = probs.to(target.device)
    expected = sampler.exponential_race(
        probs, sampler.uniform_noise_torch(seeds, positions, vocab, stream)
    )
    got = triton_noise_race.noise_race(probs, seeds, positions, stream)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)
    assert torch.equal(sampler.noise_race(probs, seeds, positions, stream), expected)
    assert probs[0, got[0]] > 0


def test_race_follows_the_distribution(target):
    """Many rows of one distribution (distinct positions): the draws' frequencies match it."""
    n, vocab = 4000, 8
    p = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01])
    probs = (p * 3.0).expand(n, vocab).contiguous().to(target.device)  # unnormalized
    seeds = torch.full((n,), 1234, dtype=torch.int64, device=target.device)
    positions = torch.arange(n, device=target.device)
    got = triton_noise_race.noise_race(probs, seeds, positions, 0).cpu()
    freq = torch.bincount(got, minlength=vocab).float() / n
    assert (freq - p).abs().max() < 0.03  # ~4 standard errors at p = 0.4
