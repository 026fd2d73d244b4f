"""The logits stages of ``logits_pipeline.PIPELINE`` (vLLM semantics), batched on the device.

Each ``apply`` takes the ``[B, 1 + W, V]`` logits of the batch's sequences (position j sees
drafts 0..j-1 as part of the sequence) and returns them processed; rows of sequences that do
not want a stage come out bit-for-bit unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from verifypd.engine.token_counts import upload
from verifypd.types import Sequence

if TYPE_CHECKING:
    from verifypd.engine.logits_pipeline import LogitsBatch

_WILDCARD = -2  # a bad word's prefix slot that matches any token (left padding)
_NO_TOKEN = -1  # history before the first output token: matches no prefix token


def with_drafts(base: Tensor, drafts: Tensor, num_drafts: Tensor) -> Tensor:
    """Output counts per verify position: [B, V] counts, [B, W] drafts, [B] real draft
    counts -> [B, 1 + W, V], position j adding drafts 0..j-1 (real drafts only)."""
    batch, width = drafts.shape
    if width == 0:
        return base[:, None, :]
    vocab = base.shape[-1]
    j = torch.arange(width + 1, device=base.device)[None, :, None]  # position
    i = torch.arange(width, device=base.device)[None, None, :]  # draft
    counted = (i < j) & (i < num_drafts[:, None, None])  # [B, 1 + W, W]
    index = torch.where(counted, drafts.clamp(0, vocab - 1)[:, None, :], vocab)
    extra = base.new_zeros(batch, width + 1, vocab + 1)  # column V takes what is not counted
    extra.scatter_add_(2, index, torch.ones_like(index, dtype=base.dtype))
    return base[:, None, :] + extra[..., :vocab]


def _add_at(logits: Tensor, batch_rows: Tensor, tokens: Tensor, values: Tensor) -> None:
    """logits[b_e, j, t_e] += values[e, j] for entries e ([E], [E], [E, 1 + W]), in place."""
    positions = torch.arange(logits.shape[1], device=logits.device)[None, :]
    shape = values.shape
    index = (
        batch_rows[:, None].expand(shape),
        positions.expand(shape),
        tokens[:, None].expand(shape),
    )
    logits.index_put_(index, values, accumulate=True)


# ---------------------------------------------------------------- bad words
def wants_bad_words(seq: Sequence) -> bool:
    return bool(seq.params.bad_words_token_ids)


def ban_bad_words(logits: Tensor, batch: LogitsBatch) -> Tensor:
    """vLLM: the last token of a bad word is banned where the output so far ends with the rest
    of the word (always, for a one-token word)."""
    words = [(b, w) for b, s in enumerate(batch.seqs) for w in s.params.bad_words_token_ids or []]
    if not words:
        return logits
    k = max(len(w) - 1 for _, w in words)  # longest prefix
    dev, width = logits.device, logits.shape[1]
    prefixes = [[_WILDCARD] * (k - len(w) + 1) + w[:-1] for _, w in words]  # right-aligned
    host = upload([[b for b, _ in words], [w[-1] for _, w in words]], dev)  # [2, E]
    if k == 0:
        matched = torch.ones(len(words), width, dtype=torch.bool, device=dev)
    else:
        tails = upload([_output_tail(s, k) for s in batch.seqs], dev)  # [B, k]
        history = torch.cat([tails, batch.drafts], dim=1)  # [B, k + W]
        windows = history.unfold(1, k, 1)[host[0]]  # [E, 1 + W, k]: before position j
        prefix = upload(prefixes, dev)[:, None, :]  # [E, 1, k]
        matched = ((prefix == _WILDCARD) | (prefix == windows)).all(dim=-1)  # [E, 1 + W]
    ban = torch.where(matched, float("-inf"), 0.0).to(logits.dtype)
    _add_at(logits, host[0], host[1], ban)
    return logits


def _output_tail(seq: Sequence, k: int) -> list[int]:
    """The last k output tokens, left-padded with ``_NO_TOKEN``."""
    n = min(k, seq.num_output_tokens)
    tail = seq.token_ids[len(seq.token_ids) - n :] if n else []
    return [_NO_TOKEN] * (k - n) + tail


# ---------------------------------------------------------------- logit bias
def wants_logit_bias(seq: Sequence) -> bool:
    return bool(seq.params.logit_bias)


def add_logit_bias(logits: Tensor, batch: LogitsBatch) -> Tensor:
    entries = [
        (b, tok, bias)
        for b, s in enumerate(batch.seqs)
        for tok, bias in (s.params.logit_bias or {}).items()
    ]
    if not entries:
        return logits
    dev = logits.device
    index = upload([[b for b, _, _ in entries], [t for _, t, _ in entries]], dev)  # [2, E]
    bias = upload([bias for *_, bias in entries], dev, logits.dtype)  # [E]
    _add_at(logits, index[0], index[1], bias[:, None].expand(-1, logits.shape[1]))
    return logits


# ---------------------------------------------------------------- min_tokens
def wants_min_tokens(seq: Sequence) -> bool:
    return seq.num_output_tokens < seq.params.min_tokens


def stop_token_ids(seq: Sequence, eos_token_ids: frozenset[int]) -> list[int]:
    """The tokens that end ``seq``: its stop_token_ids, and EOS unless ignore_eos."""
    params = seq.params
    eos = set() if params.ignore_eos else eos_token_ids
    return sorted(set(params.stop_token_ids) | eos)


def mask_stops_before_min_tokens(logits: Tensor, batch: LogitsBatch) -> Tensor:
    """Positions whose token would be output number < min_tokens (0-based) cannot stop."""
    entries = [
        (b, tok, s.params.min_tokens - s.num_output_tokens)
        for b, s in enumerate(batch.seqs)
        if wants_min_tokens(s)
        for tok in stop_token_ids(s, batch.eos_token_ids)
    ]
    if not entries:
        return logits
    dev = logits.device
    host = upload([list(col) for col in zip(*entries, strict=True)], dev)  # [3, E]
    positions = torch.arange(logits.shape[1], device=dev)[None, :]
    mask = torch.where(positions < host[2][:, None], float("-inf"), 0.0).to(logits.dtype)
    _add_at(logits, host[0], host[1], mask)
    return logits


# ---------------------------------------------------------------- penalties
def wants_penalties(seq: Sequence) -> bool:
    p = seq.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def apply_penalties(logits: Tensor, batch: LogitsBatch) -> Tensor:
    """Repetition (prompt and output tokens: positive logits divided, negative multiplied),
    then frequency (times the output count) and presence (output tokens), subtracted."""
    params = [s.params for s in batch.seqs]
    counts, rows = batch.output_counts()  # [B, 1 + W, V], [B]
    factors = upload(
        [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
         [p.presence_penalty for p in params]],
        logits.device, logits.dtype,
    )[:, :, None, None]  # fmt: skip
    seen = counts > 0
    if any(p.repetition_penalty != 1 for p in params):
        penalty = torch.where(seen | batch.counts.prompt[rows][:, None, :], factors[0], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - factors[1] * counts
    return logits - factors[2] * seen.to(logits.dtype)
