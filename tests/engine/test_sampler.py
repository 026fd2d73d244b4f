"""Sampler tests: exact supports for top-k/top-p, empirical distributions, RNG properties."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import Z_1E4, chi_square, chi_square_critical, single_thread, total_variation  # noqa: F401,E501

from verifypd.engine.sampler import (
    SamplingTensors,
    processed_probs,
    sample,
    sample_with_probs,
    uniform_noise,
)


def tensors(n: int, temperature=1.0, top_k=0, top_p=1.0, seed=0, positions=None):
    positions = list(range(n)) if positions is None else positions
    return SamplingTensors.build(
        [temperature] * n, [top_k] * n, [top_p] * n, [seed] * n, positions, "cpu"
    )


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_build_types_and_flags():
    t = SamplingTensors.build([0.0, 0.7], [5, 0], [1.0, 0.9], [3, 4], [10, 11], "cpu")
    assert t.temperature.dtype == torch.float32 and t.top_p.dtype == torch.float32
    assert t.top_k.dtype == t.seeds.dtype == t.positions.dtype == torch.int64
    assert not t.all_greedy and not t.any_top_k and t.any_top_p  # top_k only on a greedy row
    g = SamplingTensors.build([0.0, 0.0], [3, 0], [0.5, 1.0], [0, 0], [0, 0], "cpu")
    assert g.all_greedy


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    temps = [0.0 if i % 2 == 0 else 0.8 for i in range(16)]
    t = SamplingTensors.build(temps, [3] * 16, [0.5] * 16, list(range(16)), [7] * 16, "cpu")
    tokens = sample(logits, t)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    probs = processed_probs(logits, t)
    assert torch.equal(probs[::2], torch.nn.functional.one_hot(logits[::2].argmax(-1), 50).float())
    all_greedy = tensors(16, temperature=0.0)
    assert torch.equal(sample(logits, all_greedy), logits.argmax(-1))


def test_top_k_keeps_exactly_k():
    torch.manual_seed(1)
    logits = torch.randn(1, 12)
    full = torch.softmax(logits / 0.7, dim=-1)
    for k in range(1, 13):
        probs = processed_probs(logits, tensors(1, temperature=0.7, top_k=k))
        top = torch.topk(logits, k).indices[0]
        assert support(probs[0]) == set(top.tolist())
        expected = torch.zeros_like(full).index_copy_(1, top, full[:, top])
        torch.testing.assert_close(probs, expected / expected.sum(), rtol=1e-5, atol=1e-7)
    ties = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert support(processed_probs(ties, tensors(1, top_k=2))[0]) == {1, 2}


@pytest.mark.parametrize(
    "probs, top_k, top_p, expected",
    [
        ([0.05, 0.5, 0.15, 0.3], 0, 0.75, {1, 3}),
        ([0.05, 0.5, 0.15, 0.3], 0, 0.81, {1, 2, 3}),
        ([0.05, 0.5, 0.15, 0.3], 0, 0.1, {1}),
        ([0.05, 0.5, 0.15, 0.3], 0, 0.5, {1}),  # 0.5 alone reaches 0.5 (>=)
        ([0.05, 0.5, 0.15, 0.3], 0, 0.99, {0, 1, 2, 3}),
        ([0.05, 0.5, 0.15, 0.3], 0, 1.0, {0, 1, 2, 3}),
        # top-p applies to the renormalized top-k distribution {1: 0.625, 3: 0.375}
        ([0.05, 0.5, 0.15, 0.3], 2, 0.6, {1}),
        ([0.05, 0.5, 0.15, 0.3], 2, 0.7, {1, 3}),
        ([0.25, 0.25, 0.25, 0.25], 0, 0.6, {0, 1, 2}),
        ([1e-9, 1 - 2e-9, 1e-9, 0.0], 0, 1.0, {0, 1, 2}),
    ],
)
def test_top_p_nucleus(probs, top_k, top_p, expected):
    logits = torch.tensor([probs]).log()
    out = processed_probs(logits, tensors(1, top_k=top_k, top_p=top_p))[0]
    assert support(out) == expected
    kept = torch.tensor(probs)[sorted(expected)]
    torch.testing.assert_close(out[sorted(expected)], kept / kept.sum())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    vocab_size=st.integers(1, 40),
    gen_seed=st.integers(0, 2**31),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
)
def test_processed_probs_properties(vocab_size, gen_seed, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(gen_seed)
    logits = torch.randn(1, vocab_size, generator=gen) * 3
    probs = processed_probs(logits, tensors(1, temperature, top_k, top_p))[0]
    assert torch.isclose(probs.sum(), torch.tensor(1.0), atol=1e-5) and (probs >= 0).all()
    kept = sorted(support(probs), key=lambda i: -probs[i].item())
    num_top_k = min(top_k or vocab_size, vocab_size)
    assert 1 <= len(kept) <= num_top_k
    # The kept set is a top set of the top-k distribution, and the smallest one reaching top_p.
    base = torch.softmax(logits[0] / temperature, dim=-1)
    order = torch.sort(base, descending=True, stable=True).indices.tolist()
    assert kept == order[: len(kept)] or set(kept) == set(order[: len(kept)])
    k_mass = base[order[:num_top_k]].sum()
    mass = base[kept].sum() / k_mass
    assert mass >= top_p - 1e-5 or len(kept) == num_top_k
    assert base[kept[:-1]].sum() / k_mass < top_p + 1e-5


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.5, 0, 1.0), (1.0, 4, 1.0), (0.8, 0, 0.7), (1.3, 6, 0.9)],
)
def test_empirical_distribution_matches_processed_probs(temperature, top_k, top_p):
    num_draws, vocab_size = 20_000, 10
    gen = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    logits = (torch.randn(1, vocab_size, generator=gen) * 1.5).expand(num_draws, vocab_size)
    t = tensors(num_draws, temperature, top_k, top_p, seed=1234)  # fresh noise per position
    probs = processed_probs(logits[:1], tensors(1, temperature, top_k, top_p))[0]
    counts = torch.bincount(sample(logits, t), minlength=vocab_size)
    assert counts[probs == 0].sum() == 0
    stat, df = chi_square(counts, probs)
    tv = total_variation(counts, probs)
    print(f"sampler T={temperature} k={top_k} p={top_p}: chi2={stat:.1f} "
          f"crit={chi_square_critical(df):.1f} df={df} tv={tv:.4f}")  # fmt: skip
    assert stat < chi_square_critical(df)
    assert tv < 0.02


def test_same_seed_same_token_regardless_of_batch():
    torch.manual_seed(2)
    n, vocab_size = 24, 100
    logits = torch.randn(n, vocab_size) * 2
    temps = [0.0, 0.5, 1.0, 1.7] * 6
    top_k = [0, 5, 0, 20] * 6
    top_p = [1.0, 1.0, 0.8, 0.95] * 6
    seeds = list(range(100, 100 + n))
    positions = [3 * i for i in range(n)]
    t = SamplingTensors.build(temps, top_k, top_p, seeds, positions, "cpu")
    tokens = sample(logits, t)
    # Shuffle the batch and add strangers with other settings.
    perm = torch.randperm(n).tolist()
    extra = 9
    pick = lambda xs, more: [xs[i] for i in perm] + more  # noqa: E731
    t2 = SamplingTensors.build(
        pick(temps, [0.9] * extra),
        pick(top_k, [0] * extra),
        pick(top_p, [0.5] * extra),
        pick(seeds, list(range(extra))),
        pick(positions, list(range(extra))),
        "cpu",
    )
    logits2 = torch.cat([logits[perm], torch.randn(extra, vocab_size)])
    tokens2 = sample(logits2, t2)
    assert torch.equal(tokens2[:n], tokens[perm])
    assert torch.equal(sample(logits, t), tokens)  # and repeatable


def test_different_positions_and_seeds_give_different_draws():
    vocab_size = 1000
    logits = torch.zeros(200, vocab_size)
    by_position = sample(logits, tensors(200, seed=5))
    by_seed = sample(logits, SamplingTensors.build(
        [1.0] * 200, [0] * 200, [1.0] * 200, list(range(200)), [5] * 200, "cpu"
    ))  # fmt: skip
    # 200 draws from 1000 equally likely tokens: ~182 distinct expected.
    assert len(set(by_position.tolist())) > 160
    assert len(set(by_seed.tolist())) > 160
    assert (by_position != by_seed).float().mean() > 0.9


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def test_uniform_noise_range_and_moments():
    rows, cols = 1000, 1000
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63)] * 200)
    u = uniform_noise(seeds, torch.arange(rows), cols, stream=0)  # [1000, 1000]
    assert u.shape == (rows, cols) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    n = u.numel()
    assert abs(u.double().mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.double().var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    # Kolmogorov-Smirnov statistic against U(0, 1); 1.95 / sqrt(n) is the p = 0.001 critical value.
    x = u.double().flatten().sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum(grid - x, x - (grid - 1 / n)).max().item()
    print(f"uniform KS={ks * math.sqrt(n):.3f} (crit 1.95)")
    assert ks < 1.95 / math.sqrt(n)
    # 16 equal bins: chi-square.
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    stat, df = chi_square(counts, torch.full((16,), 1 / 16))
    assert stat < chi_square_critical(df)


def test_uniform_noise_no_correlation():
    rows, cols = 2000, 500
    bound = 5 / math.sqrt(rows * cols)
    u = uniform_noise(torch.full((rows,), 7), torch.arange(rows), cols, stream=0)
    other_seed = uniform_noise(torch.full((rows,), 8), torch.arange(rows), cols, stream=0)
    other_stream = uniform_noise(torch.full((rows,), 7), torch.arange(rows), cols, stream=1)
    pairs = {
        "adjacent columns": (u[:, :-1], u[:, 1:]),
        "adjacent positions": (u[:-1], u[1:]),
        "adjacent seeds": (u, other_seed),
        "streams": (u, other_stream),
    }
    for name, (a, b) in pairs.items():
        c = _corr(a, b)
        print(f"uniform corr {name}: {c:+.5f} (bound {bound:.5f})")
        assert abs(c) < bound, name
    for stream in (2, 3, 7, 2**40):  # any stream id works and gives fresh values
        c = _corr(u, uniform_noise(torch.full((rows,), 7), torch.arange(rows), cols, stream))
        assert abs(c) < bound, stream
    # Pure function of (seed, position, column, stream): a sub-batch reproduces the same values.
    sub = uniform_noise(torch.tensor([7, 7]), torch.tensor([5, 1999]), cols, stream=0)
    assert torch.equal(sub, u[[5, 1999]])


def test_sample_with_probs_is_sample_and_processed_probs():
    """A sampled drafter takes its tokens and their distribution from one call: the same as
    ``sample`` then ``processed_probs`` (greedy rows one-hot; None when every row is greedy)."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    t = SamplingTensors.build(
        temperature=[0.7, 0.0, 1.3, 0.9], top_k=[0, 0, 5, 0], top_p=[1.0, 1.0, 1.0, 0.8],
        seeds=[1, 2, 3, 4], positions=[10, 11, 12, 13], device="cpu",
    )  # fmt: skip
    tokens, probs = sample_with_probs(logits, t)
    assert torch.equal(tokens, sample(logits, t))
    assert torch.equal(probs, processed_probs(logits, t))
    assert tokens[1] == logits[1].argmax()
    greedy = tensors(4, temperature=0.0)
    tokens, probs = sample_with_probs(logits, greedy)
    assert probs is None and torch.equal(tokens, logits.argmax(dim=-1))


def test_prefix_is_the_rows_built_further_on():
    """``SamplingTensors.prefix(rows, j)``: a drafter's step j over the first rows samples as
    tensors built on the host for those rows at positions j further on would."""
    args = dict(temperature=[0.7, 1.0, 0.5], top_k=[0, 3, 0], top_p=[0.9, 1.0, 1.0],
                seeds=[7, 8, 9], positions=[20, 5, 31])  # fmt: skip
    full = SamplingTensors.build(**args, device="cpu")
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4))
    for advance in (0, 3):
        rows = {k: v[:2] for k, v in args.items()}
        rows["positions"] = [p + advance for p in rows["positions"]]
        built = SamplingTensors.build(**rows, device="cpu")
        got = full.prefix(2, advance)
        assert torch.equal(got.positions, built.positions)
        assert torch.equal(got.seeds, built.seeds) and torch.equal(got.top_k, built.top_k)
        assert torch.equal(sample(logits, got), sample(logits, built))
        assert torch.equal(processed_probs(logits, got), processed_probs(logits, built))
    assert torch.equal(full.positions, torch.tensor([20, 5, 31]))  # the whole batch untouched


def test_fused_noise_is_set_by_the_engine_from_its_kernel_knob(monkeypatch):
    """``KernelConfig.fused_sampling_noise`` reaches the sampler when the engine is built: on
    only with the Triton kernel set (never on CPU torch ops)."""
    from helpers import tiny_config

    from verifypd.config import KernelConfig
    from verifypd.engine import sampler, setup

    seen: list[bool] = []
    monkeypatch.setattr(sampler, "use_fused_noise", seen.append)
    for on in (False, True):
        setup.build_engine(tiny_config(kernels=KernelConfig(fused_sampling_noise=on)), None)
    assert seen == [False, False]  # CPU: torch ops, whatever the knob
    real_get_ops = setup.get_ops  # the Triton kernel set asked for; torch ops run this CPU test
    monkeypatch.setattr(setup, "get_ops", lambda use_triton, knobs: real_get_ops(False, knobs))
    for on in (False, True):
        setup.build_engine(
            tiny_config(use_triton=True, kernels=KernelConfig(fused_sampling_noise=on)), None
        )
    assert seen == [False, False, False, True]


def test_a_batch_without_greedy_rows_skips_the_greedy_mix_and_draws_the_same():
    """``any_greedy`` False (every row sampled) leaves out the one-hot rows:
    the same distribution and the same draws as the general path."""
    logits = torch.randn(3, 60, generator=torch.Generator().manual_seed(8))
    t = SamplingTensors.build([0.7, 1.0, 1.4], [0, 4, 0], [1.0, 1.0, 0.9], [1, 2, 3], [5, 6, 7],
                              "cpu")  # fmt: skip
    assert not t.any_greedy and t.prefix(2, 1).any_greedy is False
    general = dataclasses.replace(t, any_greedy=True)
    assert torch.equal(processed_probs(logits, t), processed_probs(logits, general))
    assert torch.equal(sample(logits, t), sample(logits, general))
    mixed = SamplingTensors.build([0.7, 0.0], [0, 0], [1.0, 1.0], [1, 2], [5, 6], "cpu")
    assert mixed.any_greedy
