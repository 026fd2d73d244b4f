"""Lossless speculative verification (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"), batched and sync-free.

For draft j with target distribution p_j and draft distribution q_j, the draft token x_j is
accepted with probability min(1, p_j(x_j) / q_j(x_j)). At the first rejection the emitted token
is drawn from normalize(max(0, p_j - q_j)); if every draft is accepted a bonus token is drawn
from p_{L_b}. The emitted sequence is then distributed exactly as sampling from the target.

Noise: acceptance uses stream 1 and the final (correction or bonus) token stream 2, both at
counter ``position + j``, so it is independent of the drafter's stream-0 noise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from verifypd.engine.sampler import noise_race, uniform_host, uniform_noise

ACCEPT_STREAM = 1
FINAL_STREAM = 2
SYNTHETIC_STREAM = 3


def _position_uniforms(seeds: Tensor, positions: Tensor, num_positions: int, stream: int) -> Tensor:
    """One uniform per (row, position + j): [B], [B] -> [B, num_positions] in (0, 1)."""
    offsets = torch.arange(num_positions, device=seeds.device)
    flat_positions = (positions[:, None] + offsets[None, :]).reshape(-1)  # [B * L]
    flat_seeds = seeds.repeat_interleave(num_positions)  # [B * L]
    return uniform_noise(flat_seeds, flat_positions, 1, stream).view(len(seeds), num_positions)


def _gather_rows(probs: Tensor, index: Tensor) -> Tensor:
    """probs [B, L, V], index [B] -> probs[b, index[b]] as [B, V]."""
    vocab_size = probs.shape[-1]
    return probs.gather(1, index[:, None, None].expand(-1, 1, vocab_size)).squeeze(1)


def _draft_dist_at(draft_probs: Tensor | None, draft_ids: Tensor, k: Tensor, vocab_size: int):
    """q_k [B, V] at per-row index k (clamped into [0, L - 1]); one-hot when ``draft_probs`` is
    None (deterministic proposer)."""
    num_drafts_max = draft_ids.shape[1]
    if num_drafts_max == 0:
        return torch.zeros(draft_ids.shape[0], vocab_size, device=draft_ids.device)
    k = k.clamp(max=num_drafts_max - 1)
    if draft_probs is not None:
        return _gather_rows(draft_probs.to(torch.float32), k)
    token = draft_ids.gather(1, k[:, None])  # [B, 1]
    q = torch.zeros(draft_ids.shape[0], vocab_size, device=draft_ids.device)
    return q.scatter_(1, token, 1.0)


def _final_tokens(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_ids: Tensor,
    num_accepted: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> Tensor:
    """The token emitted after the accepted drafts: [B] int64.

    Rows that rejected draft k draw from max(0, p_k - q_k) (p_k if that is all zero); rows that
    accepted all drafts draw the bonus token from p_{L_b} (q is taken as 0 there).
    """
    vocab_size = target_probs.shape[-1]
    k = num_accepted  # [B]
    p_k = _gather_rows(target_probs, k)  # [B, V]
    q_k = _draft_dist_at(draft_probs, draft_ids, k, vocab_size)  # [B, V]
    q_k = q_k.masked_fill((k >= num_drafts)[:, None], 0.0)
    residual = (p_k - q_k).clamp(min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_k)
    # Unnormalized is fine: the race's argmax is scale-free.
    return noise_race(residual.contiguous(), seeds, positions + k, FINAL_STREAM)


def rejection_sample(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """Verify drafts against the target, exactly preserving the target distribution.

    Args:
        target_probs: [B, L+1, V] processed target distributions at the L+1 verify positions.
        draft_probs: [B, L, V] distributions the drafts were sampled from, or None for a
            deterministic proposer (q_j is one-hot at the draft token).
        draft_token_ids: [B, L] int64, padded (any value) beyond ``num_drafts``.
        num_drafts: [B] int64, L_b <= L drafts per row.
        seeds: [B] int64 per-request seeds.
        positions: [B] int64 sequence position of the first verified token; draft j uses
            counter position + j.

    Returns:
        output_token_ids: [B, L+1] int64: accepted drafts then the final token, padded with -1.
        num_accepted: [B] int64; row b emits num_accepted[b] + 1 tokens.

    Greedy rows pass one-hot ``target_probs``: acceptance is then an argmax match and the final
    token is the target argmax.
    """
    batch_size, num_verify, vocab_size = target_probs.shape
    max_drafts = num_verify - 1
    target_probs = target_probs.to(torch.float32)
    num_drafts = num_drafts.clamp(max=max_drafts)
    offsets = torch.arange(max_drafts, device=target_probs.device)  # [L]
    is_draft = offsets[None, :] < num_drafts[:, None]  # [B, L]
    draft_ids = torch.where(is_draft, draft_token_ids, 0).clamp(0, vocab_size - 1)  # [B, L]

    p_x = target_probs[:, :max_drafts].gather(2, draft_ids[..., None]).squeeze(2)  # [B, L]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.to(torch.float32).gather(2, draft_ids[..., None]).squeeze(2)
    uniforms = _position_uniforms(seeds, positions, max_drafts, ACCEPT_STREAM)  # [B, L]
    accepted = is_draft & (uniforms * q_x < p_x)  # u < p/q without dividing by q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    final = _final_tokens(
        target_probs, draft_probs, draft_ids, num_accepted, num_drafts, seeds, positions
    )
    output = torch.full((batch_size, num_verify), -1, dtype=torch.int64, device=final.device)
    output[:, :max_drafts] = torch.where(offsets[None, :] < num_accepted[:, None], draft_ids, -1)
    output.scatter_(1, num_accepted[:, None], final[:, None])
    return output, num_accepted


def synthetic_num_accepted(
    alphas: list[float], num_drafts: list[int], seeds: list[int], positions: list[int]
) -> list[int]:
    """Benchmark only: accepted counts drawn as min(G, L_b) with G geometric,
    P(G >= n) = alpha_b^n (each draft accepted with prob alpha_b until the first rejection);
    one alpha per row (a request's own ``SamplingParams.synthetic_acceptance`` or the engine's).

    Inverse CDF: G = floor(log u / log alpha), so P(G >= n) = P(u <= alpha^n) = alpha^n. Drawn
    on the host from the seeds and positions (``uniform_host``), so the benchmark's stand-in
    for acceptance adds no GPU work to the verify that a real greedy verify does not have.
    """
    out = []
    for alpha, n, seed, pos in zip(alphas, num_drafts, seeds, positions, strict=True):
        if alpha >= 1.0 or n == 0:
            out.append(n if alpha >= 1.0 else 0)
            continue
        if alpha <= 0.0:
            out.append(0)
            continue
        u = uniform_host(seed, pos, 0, SYNTHETIC_STREAM)
        out.append(min(math.floor(math.log(u) / math.log(alpha)), n))
    return out


def emit_accepted(drafts: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:
    """[B, L] drafts, [B] accepted counts k, [B] final tokens -> [B, L + 1] output ids: the
    first k drafts, then the final token, then -1 padding."""
    cols = torch.arange(drafts.shape[1] + 1, device=drafts.device)  # [L + 1]
    padded = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)
    out = torch.where(cols[None, :] < num_accepted[:, None], padded, -1)
    return out.scatter(1, num_accepted[:, None], final[:, None])


def greedy_accept(
    target_ids: Tensor, draft_token_ids: Tensor, num_drafts: Tensor
) -> tuple[Tensor, Tensor]:
    """Greedy verification without V-wide work: ``target_ids`` [B, L+1] are the target's argmax
    ids at the verify positions. Accepts the longest prefix of drafts equal to them; the final
    token is the target's argmax after it. Same result as ``rejection_sample`` on one-hot p."""
    width = draft_token_ids.shape[1]
    cols = torch.arange(width, device=draft_token_ids.device)
    match = (draft_token_ids == target_ids[:, :width]) & (cols[None, :] < num_drafts[:, None])
    num_accepted = match.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    final = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return emit_accepted(draft_token_ids, num_accepted, final), num_accepted


def warm_noise(device: torch.device, vocab_sizes: set[int]) -> None:
    """Start-up (GPU, ``KernelConfig.fused_sampling_noise``): the noise kernels at every stream
    the steps draw with and at each vocabulary, once. A kernel's stream is a compile-time
    constant, so the first sampled draw, rejection test or residual draw of each compiled
    under traffic (a stall of every lane)."""
    if device.type != "cuda":
        return
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    for vocab in sorted(vocab_sizes):
        probs = torch.ones(2, vocab, dtype=torch.float32, device=device)
        for stream in (0, FINAL_STREAM):  # a sampled token; a rejected draft's residual draw
            noise_race(probs, seeds, seeds, stream)
    uniform_noise(seeds, seeds, 1, ACCEPT_STREAM)  # the acceptance tests
