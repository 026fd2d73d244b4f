"""What the engine refuses up front: input that can never be served, and requests whose worst
case would take more than their share of the KV pool (``max_request_kv_share``).

A request's worst case is every one of its ``n`` choices at full length (prompt + max_tokens),
plus room for the longest draft when speculating; the drafter's pool has as many blocks as the
target's, so one bound covers both. Under preemption a request beyond its share would evict
everyone else and starve them; beyond the whole pool it could never finish.

``resolve_max_tokens`` is the one context rule (prompt + max_tokens within the context): the
server applies it before admitting a request (to default max_tokens and answer 400 early), and
``RequestLimits.validate`` applies it again for callers that bypass the server (``LLM``, the CLI).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verifypd.types import ParamError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_share: float  # of ``num_blocks`` one request may need
    draft_slack: int = 0  # slots reserved past the last token for drafts (max_draft_len)

    @property
    def max_request_blocks(self) -> int:
        return max(1, int(self.kv_share * self.num_blocks))

    def request_blocks(self, num_prompt: int, max_tokens: int, n: int) -> int:
        """Worst-case KV blocks of a request (each choice at full length, drafts included)."""
        return n * -(-(num_prompt + max_tokens + self.draft_slack) // self.block_size)

    def max_choice_len(self, n: int = 1) -> int:
        """The longest prompt + max_tokens each of ``n`` choices may have: the context length
        and the request's share of the pool (``request_blocks``' inverse)."""
        share_len = self.max_request_blocks // n * self.block_size - self.draft_slack
        return max(0, min(self.max_model_len, share_len))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ParamError (naming the field) for a request that must not enter the engine."""
        n = len(prompt_token_ids)
        resolve_max_tokens(n, params.max_tokens, self.max_model_len)
        _check_token_ids("prompt", prompt_token_ids, self.vocab_size)
        _check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        _check_token_ids("logit_bias", list(params.logit_bias or {}), self.vocab_size)
        if params.top_k > self.vocab_size:
            vocab = self.vocab_size
            raise ParamError("top_k", f"top_k must be -1, 0 or in [1, {vocab}] (the vocabulary)")
        self._check_kv_need(n, params)

    def _check_kv_need(self, num_prompt: int, params: SamplingParams) -> None:
        need = self.request_blocks(num_prompt, params.max_tokens, params.n)
        total, limit = self.num_blocks, self.max_request_blocks
        if need > limit:
            what = "exceeds the whole KV cache" if need > total else "exceeds its share"
            raise ParamError(
                "max_tokens",
                f"n ({params.n}) x (prompt ({num_prompt}) + max_tokens ({params.max_tokens})) "
                f"needs {need} KV blocks, which {what}: one request may hold at most {limit} of "
                f"the {total} blocks (max_request_kv_share). Lower max_tokens or n.",
            )


def resolve_max_tokens(
    num_prompt: int,
    requested: int | None,
    max_len: int,
    param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> int:
    """The context rule: ``requested``, or the rest of the context ``max_len`` when it is None.
    Raises ParamError naming ``max_tokens_param`` when max_tokens alone cannot fit, else the
    prompt's field ``param`` (``prompt`` or ``messages``)."""
    if requested is not None and requested >= max_len:
        raise ParamError(
            max_tokens_param,
            f"{max_tokens_param}={requested} leaves no room for a prompt in this model's "
            f"maximum context length (max_model_len) of {max_len} tokens.",
        )
    if num_prompt == 0:
        raise ParamError(param, f"'{param}' must not be empty")
    if num_prompt >= max_len:
        raise ParamError(
            param,
            f"The prompt has {num_prompt} tokens but this model's maximum context length "
            f"(max_model_len) is {max_len} tokens, leaving no room for max_tokens >= 1.",
        )
    if requested is None:
        return max_len - num_prompt
    if num_prompt + requested > max_len:
        raise ParamError(
            param,
            f"This model's maximum context length (max_model_len) is {max_len} tokens, "
            f"but the request needs {num_prompt + requested}: {num_prompt} prompt tokens plus "
            f"{max_tokens_param}={requested}. Shorten the prompt or lower {max_tokens_param}.",
        )
    return requested


def check_synthetic_acceptance(params: SamplingParams, engine_alpha: float | None) -> None:
    """A per-request synthetic alpha (benchmark only) needs an engine in synthetic mode
    (``SpecConfig.synthetic_acceptance`` set): elsewhere it would silently do nothing."""
    if params.synthetic_acceptance is not None and engine_alpha is None:
        raise ParamError(
            "synthetic_acceptance",
            "synthetic_acceptance is a benchmark-only field: this server does not run with "
            "synthetic acceptance (start it with --synthetic-acceptance)",
        )


def arrival_of(arrival_time: float | None, now: float) -> float:
    """A request's arrival (``time.monotonic()``) as its front stamped it, or ``now`` without
    one; a stamp after ``now`` is ``now``. Raises ParamError for one that is not a finite
    number."""
    if arrival_time is None:
        return now
    number = isinstance(arrival_time, (int, float)) and not isinstance(arrival_time, bool)
    if not number or not math.isfinite(arrival_time):
        raise ParamError("arrival_time", f"arrival_time must be a time.monotonic() reading, got "
                         f"{arrival_time!r}")  # fmt: skip
    return min(arrival_time, now)


def _check_token_ids(param: str, token_ids: list[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ParamError(param, f"{param} must hold token ids in [0, {vocab_size})")
