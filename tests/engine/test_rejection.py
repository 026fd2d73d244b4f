"""Speculative rejection sampling tests: the emitted tokens follow the target distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import Z_1E4, chi_square, chi_square_critical, single_thread, total_variation  # noqa: F401,E501

from verifypd.engine.rejection import rejection_sample, synthetic_num_accepted
from verifypd.engine.sampler import (
    SamplingTensors,
    processed_probs,
    sample,
    uniform_host,
    uniform_noise,
)

NUM_ROWS = 20_000  # independent requests in one batched call


def assert_matches(counts: torch.Tensor, probs: torch.Tensor, tv_bound: float, label: str):
    counts, probs = counts.flatten(), probs.flatten()
    assert counts[probs == 0].sum() == 0, f"{label}: emitted a token the target never emits"
    stat, df = chi_square(counts, probs)
    tv = total_variation(counts, probs)
    crit = chi_square_critical(df)
    print(f"{label}: chi2={stat:.1f} crit={crit:.1f} df={df} tv={tv:.4f}")
    assert stat < crit, f"{label}: chi2 {stat:.1f} >= {crit:.1f}"
    assert tv < tv_bound, f"{label}: tv {tv:.4f}"


def processed_table(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    n = logits.shape[0]
    t = SamplingTensors.build([temperature] * n, [top_k] * n, [top_p] * n, [0] * n, [0] * n, "cpu")
    return processed_probs(logits, t)


def plain_tensors(seeds: torch.Tensor, positions: torch.Tensor) -> SamplingTensors:
    ones = torch.ones(seeds.shape[0])
    zeros = torch.zeros(seeds.shape[0], dtype=torch.int64)
    return SamplingTensors(ones, zeros, ones, seeds, positions, False, False, False)


def markov_round(P, Q, context, num_drafts, seeds, positions, max_drafts, deterministic):
    """One draft + verify round for a Markov target P[prev] and drafter Q[prev] ([V, V] tables).

    The drafter samples x_j ~ Q[x_{j-1}] with ``sample`` (stream 0 at position + j), or proposes
    argmax Q[x_{j-1}] when ``deterministic``; the target sees P[x_{j-1}] at verify position j.
    """
    prev, drafts, draft_dists, target_dists = context, [], [], []
    for j in range(max_drafts):
        target_dists.append(P[prev])
        q = Q[prev]  # [S, V]
        x = q.argmax(-1) if deterministic else sample(q.log(), plain_tensors(seeds, positions + j))
        drafts.append(x)
        draft_dists.append(q)
        prev = x
    target_dists.append(P[prev])
    is_draft = torch.arange(max_drafts)[None, :] < num_drafts[:, None]
    draft_ids = torch.where(is_draft, torch.stack(drafts, 1), -1)  # padded with -1
    draft_probs = None if deterministic else torch.stack(draft_dists, 1)
    out, num_accepted = rejection_sample(
        torch.stack(target_dists, 1), draft_probs, draft_ids, num_drafts, seeds, positions
    )
    assert (num_accepted <= num_drafts).all() and (num_accepted >= 0).all()
    emitted = torch.arange(max_drafts + 1)[None, :] <= num_accepted[:, None]
    assert ((out >= 0) == emitted).all(), "outputs must be padded with -1 exactly"
    accepted = torch.arange(max_drafts)[None, :] < num_accepted[:, None]
    assert torch.equal(out[:, :max_drafts][accepted], draft_ids[accepted])
    return out, num_accepted


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    vocab_size=st.integers(2, 5),
    max_drafts=st.integers(1, 4),
    gen_seed=st.integers(0, 2**31),
    scale=st.floats(0.3, 2.0),
    target_temp=st.sampled_from([0.7, 1.0, 1.5, 3.0, 0.4, 0.0]),
    target_top_k=st.sampled_from([0, 3, 2, 4]),
    target_top_p=st.sampled_from([1.0, 0.95, 0.8, 0.6]),
    drafter=st.sampled_from(["independent", "equal", "deterministic"]),
    draft_temp=st.sampled_from([1.0, 0.5, 2.0, 4.0]),
    draft_top_k=st.sampled_from([0, 2, 3, 1]),
)
def test_emitted_tokens_follow_target(
    vocab_size, max_drafts, gen_seed, scale, target_temp, target_top_k, target_top_p,
    drafter, draft_temp, draft_top_k,
):  # fmt: skip
    gen = torch.Generator().manual_seed(gen_seed)
    V, S = vocab_size, NUM_ROWS
    P = processed_table(torch.randn(V, V, generator=gen) * scale, target_temp, target_top_k,
                        target_top_p)  # fmt: skip
    Q = processed_table(torch.randn(V, V, generator=gen) * scale, draft_temp, draft_top_k, 1.0)
    Q = P.clone() if drafter == "equal" else Q
    seeds = torch.arange(S) * 7919 + gen_seed
    positions = torch.full((S,), 11) + torch.randint(0, 1000, (S,), generator=gen)
    num_drafts = torch.randint(0, max_drafts + 1, (S,), generator=gen)  # includes padding rows
    context = torch.zeros(S, dtype=torch.int64)
    deterministic = drafter == "deterministic"

    out, num_accepted = markov_round(
        P, Q, context, num_drafts, seeds, positions, max_drafts, deterministic
    )
    if drafter == "equal":
        assert torch.equal(num_accepted, num_drafts), "q == p must accept every draft"
    first = out[:, 0]
    # Rows that emitted one token continue with a second round from that token.
    out2, _ = markov_round(P, Q, first, num_drafts, seeds, positions + 1, max_drafts, deterministic)
    second = torch.where(num_accepted >= 1, out[:, 1], out2[:, 0])

    assert_matches(torch.bincount(first, minlength=V), P[0], 0.02, f"first V={V} L={max_drafts}")
    joint = P[0][:, None] * P  # P(t0 = a, t1 = b) = P[0][a] * P[a][b]
    joint_counts = torch.bincount(first * V + second, minlength=V * V)
    assert_matches(joint_counts, joint, 0.03, f"joint {drafter}")


def test_residual_is_required():
    """Sanity check of the test's power: resampling from p instead of max(0, p - q) on rejection
    is biased, and the chi-square bound sees it."""
    V = 4
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.1, 0.1, 0.1, 0.7])
    seeds = torch.arange(NUM_ROWS)
    x = sample(q.log().expand(NUM_ROWS, V), plain_tensors(seeds, torch.zeros_like(seeds)))
    target = p.expand(NUM_ROWS, 2, V)
    out, _ = rejection_sample(
        target, q.expand(NUM_ROWS, 1, V), x[:, None], torch.ones_like(seeds), seeds, 0 * seeds
    )
    counts = torch.bincount(out[:, 0], minlength=V)
    assert_matches(counts, p, 0.02, "residual")
    # A biased sampler (accept test right, but resample from p): analytic emitted distribution.
    accept = torch.minimum(p, q)
    biased = accept + (1 - accept.sum()) * p
    stat, df = chi_square(counts, biased)
    assert stat > 10 * chi_square_critical(df)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_equivalence(with_draft_probs):
    gen = torch.Generator().manual_seed(3)
    B, L, V = 64, 4, 20
    logits = torch.randn(B, L + 1, V, generator=gen)
    greedy = logits.argmax(-1)  # [B, L+1]
    target = torch.nn.functional.one_hot(greedy, V).float()
    num_drafts = torch.randint(0, L + 1, (B,), generator=gen)
    match_len = torch.randint(0, L + 1, (B,), generator=gen)
    drafts = torch.randint(0, V, (B, L), generator=gen)
    j = torch.arange(L)[None, :]
    drafts = torch.where(j < match_len[:, None], greedy[:, :L], drafts)
    wrong = (greedy[:, :L] + 1 + torch.randint(0, V - 1, (B, L), generator=gen)) % V
    drafts = torch.where(j == match_len[:, None], wrong, drafts)  # first mismatch
    drafts = torch.where(j < num_drafts[:, None], drafts, -1)
    draft_probs = (
        torch.softmax(torch.randn(B, L, V, generator=gen), -1) if with_draft_probs else None
    )
    seeds = torch.arange(B)
    out, num_accepted = rejection_sample(target, draft_probs, drafts, num_drafts, seeds, 5 * seeds)
    expected_accepted = torch.minimum(match_len, num_drafts)
    assert torch.equal(num_accepted, expected_accepted)
    emitted = torch.arange(L + 1)[None, :] <= expected_accepted[:, None]
    assert torch.equal(out, torch.where(emitted, greedy, -1))


def test_q_equal_p_accepts_all_and_emits_bonus():
    gen = torch.Generator().manual_seed(4)
    B, L, V = 512, 4, 8
    target = torch.softmax(torch.randn(B, L + 1, V, generator=gen) * 2, -1)
    seeds, positions = torch.arange(B), torch.full((B,), 40)
    drafts = torch.stack(
        [sample(target[:, j].log(), plain_tensors(seeds, positions + j)) for j in range(L)], 1
    )
    num_drafts = torch.randint(0, L + 1, (B,), generator=gen)
    out, num_accepted = rejection_sample(
        target, target[:, :L].clone(), drafts, num_drafts, seeds, positions
    )
    assert torch.equal(num_accepted, num_drafts)
    bonus = out[torch.arange(B), num_drafts]  # drawn from p_{L_b}: inside its support
    assert (target[torch.arange(B), num_drafts, bonus] > 0).all()
    assert (out[torch.arange(L + 1)[None, :] > num_drafts[:, None]] == -1).all()


def test_padding_rows_and_no_drafts():
    V = 6
    target = torch.softmax(torch.randn(3, 4, V), -1)
    drafts = torch.tensor([[-1, -1, -1], [2, -1, -1], [1, 2, 3]])
    num_drafts = torch.tensor([0, 1, 3])
    out, num_accepted = rejection_sample(
        target, None, drafts, num_drafts, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])
    )
    assert out.shape == (3, 4) and out.dtype == torch.int64
    assert num_accepted[0] == 0 and (out[0, 1:] == -1).all() and out[0, 0] >= 0
    assert num_accepted[1] <= 1 and (out[1, 2:] == -1).all()
    # L = 0: a plain draw from p_0.
    no_drafts = torch.zeros(3, 0, dtype=torch.int64)
    zeros = torch.zeros(3, dtype=torch.int64)
    out0, acc0 = rejection_sample(target[:, :1], None, no_drafts, zeros, zeros + 1, zeros)
    assert out0.shape == (3, 1) and (acc0 == 0).all() and (out0 >= 0).all()


def test_deterministic_and_batch_independent():
    gen = torch.Generator().manual_seed(5)
    B, L, V = 32, 3, 10
    target = torch.softmax(torch.randn(B, L + 1, V, generator=gen), -1)
    draft_probs = torch.softmax(torch.randn(B, L, V, generator=gen), -1)
    drafts = torch.randint(0, V, (B, L), generator=gen)
    num_drafts = torch.randint(0, L + 1, (B,), generator=gen)
    seeds, positions = torch.arange(B) + 100, torch.arange(B) * 3
    args = (target, draft_probs, drafts, num_drafts, seeds, positions)
    out, acc = rejection_sample(*args)
    perm = torch.randperm(B, generator=gen)
    out_p, acc_p = rejection_sample(*(a[perm] for a in args))
    assert torch.equal(out_p, out[perm]) and torch.equal(acc_p, acc[perm])
    half = rejection_sample(*(a[: B // 2] for a in args))
    assert torch.equal(half[0], out[: B // 2])


def test_synthetic_num_accepted_is_truncated_geometric():
    S = NUM_ROWS
    for alpha, L in [(0.0, 4), (0.3, 4), (0.6, 2), (0.8, 6), (0.95, 3), (1.0, 5)]:
        got = torch.tensor(synthetic_num_accepted([alpha] * S, [L] * S, list(range(S)), [17] * S))
        assert (got >= 0).all() and (got <= L).all()
        # P(n) = alpha^n (1 - alpha) for n < L, P(L) = alpha^L.
        pmf = torch.tensor([alpha**n * (1 - alpha) for n in range(L)] + [alpha**L])
        mean = (pmf * torch.arange(L + 1)).sum().item()
        sd = math.sqrt((pmf * (torch.arange(L + 1) - mean) ** 2).sum().item() / S)
        err = abs(got.double().mean().item() - mean)
        print(f"synthetic alpha={alpha} L={L}: mean err {err:.4f} (5 sd = {5 * sd:.4f})")
        assert err <= 5 * sd + 1e-9
        assert_matches(torch.bincount(got, minlength=L + 1), pmf, 0.02, f"synthetic {alpha}")
    assert synthetic_num_accepted([1.0] * 3, [3, 0, 7], [0, 1, 2], [0, 0, 0]) == [3, 0, 7]
    assert synthetic_num_accepted([0.0] * 3, [3, 0, 7], [0, 1, 2], [0, 0, 0]) == [0, 0, 0]


def test_host_uniforms_are_the_device_uniforms_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**62, (64,), generator=gen)
    positions = torch.randint(0, 100_000, (64,), generator=gen)
    for stream in (0, 3):
        dev = uniform_noise(seeds, positions, 5, stream)
        host = [[uniform_host(int(s), int(p), c, stream) for c in range(5)]
                for s, p in zip(seeds, positions, strict=True)]  # fmt: skip
        assert dev.tolist() == host
