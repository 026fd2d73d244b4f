"""Host-side preparation of a request's sampling controls: bad words turned into token
sequences (as vLLM does). Token ids are checked against the vocabulary in ``admission``."""

from __future__ import annotations

from typing import Any

from verifypd.types import SamplingParams


def resolve_bad_words(params: SamplingParams, tokenizer: Any) -> None:
    """Fills ``params.bad_words_token_ids`` from ``params.bad_words`` (once): each word as
    tokenized at the start of a text and, where that gives other tokens of the same count, after
    a space (vLLM's rule, so a word is banned at the start and in the middle of a text)."""
    if params.bad_words_token_ids is not None or not params.bad_words:
        return
    resolved: list[list[int]] = []
    for word in params.bad_words:
        bare = _encode(tokenizer, word.lstrip())
        spaced = _encode(tokenizer, " " + word.lstrip())
        resolved += [ids for ids in (bare,) if ids]
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            resolved.append(spaced)
    params.bad_words_token_ids = resolved


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
