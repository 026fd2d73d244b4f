"""A one-row, loop-by-loop reference of the logits pipeline (vLLM's semantics), written
independently of the batched stages: the tests compare the engine's batched, per-position
processing against it."""

from __future__ import annotations

import torch

from verifypd.types import SamplingParams


def reference_row(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """[V] logits of the next token after ``prompt + output`` -> processed [V] logits."""
    x = logits.clone()
    for word in params.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        for token in stops:
            x[token] = float("-inf")
    counts = torch.zeros_like(x)
    for token in output:
        counts[token] += 1
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    x = x - params.frequency_penalty * counts
    return x - params.presence_penalty * (counts > 0).to(x.dtype)
