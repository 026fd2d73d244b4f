"""A request's sampling parameters (``SamplingParams``, OpenAI-compatible names), their
validation error (``ParamError``) and the seed arithmetic; re-exported from ``verifypd.types``.

Plain data only: no tensors, no HTTP. Every layer may import this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, compiled by ``engine.grammar`` (xgrammar).

    ``kind``: ``json`` (``spec`` is a JSON schema as JSON text), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (``spec`` is a JSON list of strings) or ``grammar`` (EBNF).
    ``param`` is the request field it came from, named in the 400 when it does not compile.
    """

    kind: str
    spec: str = ""
    param: str = "structured_outputs"


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI-compatible names)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    priority: int = 0  # higher is admitted first
    speculate: bool = True  # False: this request never speculates
    # Logits controls (vLLM semantics; engine/logits_stages.py applies them on the device).
    presence_penalty: float = 0.0  # output tokens: logits -= presence * (count > 0)
    frequency_penalty: float = 0.0  # output tokens: logits -= frequency * count
    repetition_penalty: float = 1.0  # prompt and output tokens, as transformers applies it
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids masked (and stops ignored) until this many
    bad_words: list[str] = field(default_factory=list)  # never generated (their last token)
    bad_words_token_ids: list[list[int]] | None = None  # resolved from bad_words by the engine
    include_stop_str_in_output: bool = False  # keep a stop string's / stop token's text
    # False: no text is made (deltas carry token ids, ``new_text`` stays ""), as vLLM's
    # ``SamplingParams.detokenize``; for callers that only read ids (the per-token host cost of
    # incremental detokenizing is gone). Stop strings need the text: refused with it off.
    detokenize: bool = True
    # Set in __post_init__: whether any logits control is on (the sampler's fast-path test).
    uses_logits_controls: bool = field(default=False, init=False, repr=False)
    # Log-probabilities (raw: log_softmax of the logits before temperature and penalties).
    # ``logprobs``: of every output token, with its ``logprobs`` most likely alternatives
    # (0 = the token's own only); ``prompt_logprobs``: the same for the prompt tokens.
    # None = off.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # grammar-constrained output
    # Benchmark only: this request's synthetic acceptance alpha (each draft accepted with this
    # probability until the first rejection) instead of the engine's global
    # ``SpecConfig.synthetic_acceptance``; refused by an engine that is not in synthetic mode.
    synthetic_acceptance: float | None = None
    # vLLM's ``cache_salt``: prefix-cache blocks are shared only between requests with the same
    # salt (None: the unsalted pool), so a tenant cannot time another's cached prompts, and a
    # benchmark can replay a prompt without hitting the last run's cache.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1, 0 or positive"),
            (self.n >= 1, "n", "must be >= 1"),
            (self.top_k <= INT64_MAX, "top_k", f"must be <= {INT64_MAX}"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "must fit int64"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (0 < self.repetition_penalty < math.inf, "repetition_penalty", "must be > 0"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (self.detokenize or not self.stop, "stop", "stop strings need detokenize=True"),
            (_biases_in_range(self.logit_bias), "logit_bias", "values must be in [-100, 100]"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs",
                "must be >= 0",
            ),
            (
                self.synthetic_acceptance is None or 0 <= self.synthetic_acceptance <= 1,
                "synthetic_acceptance",
                "must be in [0, 1]",
            ),
            (
                self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
                "cache_salt",
                "must be a non-empty string if given",
            ),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ParamError(name, f"{name} {msg}")
        self.uses_logits_controls = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.logit_bias or self.min_tokens or self.bad_words or self.bad_words_token_ids
        )  # fmt: skip

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _biases_in_range(logit_bias: dict[int, float] | None) -> bool:
    return all(-100 <= b <= 100 for b in (logit_bias or {}).values())


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_STRIDE = 1_000_003  # choice i of a request with seed s samples with seed s + i * stride


def wrap_int64(value: int) -> int:
    """``value`` mod 2^64 as a signed int64: derived seeds never overflow the sampler's int64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value > INT64_MAX else value


class ParamError(ValueError):
    """Invalid request input; ``param`` names the offending field (OpenAI error ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
