"""Shared types: sampling parameters, sequences, step plans, outputs and the observer hook.

Plain data only: no tensors, no HTTP. Every layer may import this module.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runner-side half of a drafted entry; types stays torch-free
    import torch

    from verifypd.engine.device_drafts import DeviceDrafts


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


@dataclass
class TokenLogprob:
    """One token's raw log-probability and the ``top`` most likely tokens at its position
    (``(token_id, logprob)``, most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class ParamError(ValueError):
    """Invalid request input; ``param`` names the offending field (OpenAI error ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestFailure(Exception):
    """A step could not be built because of some requests' own inputs (``request_ids``, e.g.
    their sampling tensors): those requests end with "error", the step's others are not at
    fault and run without them."""

    def __init__(self, request_ids: set[str], cause: BaseException) -> None:
        super().__init__(f"requests {sorted(request_ids)} failed: {cause!r}")
        self.request_ids = request_ids


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    VERIFYING = "verifying"
    FINISHED = "finished"
    ABORTED = "aborted"
    PREEMPTED = "preempted"

    @property
    def is_finished(self) -> bool:
        return self in (SeqStatus.FINISHED, SeqStatus.ABORTED)


_seq_counter = itertools.count()


class Sequence:
    """One generation stream. Owns its tokens, progress counters and block table.

    Invariants: ``num_computed_tokens <= num_tokens``; the KV of tokens
    ``[0, num_computed_tokens)`` is in the blocks of ``block_table`` (in order).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # choice index for n > 1
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Per-request RNG stream: sampling noise is a function of (seed, position) only.
        self.seed = params.seed if params.seed is not None else _random_seed()
        if params.seed is not None and index:
            self.seed = wrap_int64(params.seed + SEED_STRIDE * index)
        # Acceptance counts (a step's draft length is per-step data: ``ScheduledSeq.draft_len``).
        self.num_drafted = 0
        self.num_accepted = 0
        self.acceptance_ewma = 1.0
        self.num_preemptions = 0
        self.in_flight = 0  # number of launched steps not yet folded back in
        # Log-probabilities (params.logprobs / prompt_logprobs): one per output token, and one
        # per prompt token from the second on (the first has no context to be scored in).
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt log-probs were asked for and are not all computed (the prefill
        must then run over every prompt position: no prefix-cache reuse)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_prefill_done(self) -> bool:
        """True once every token but the last has KV (the decode invariant)."""
        return self.num_computed_tokens >= self.num_tokens - 1 and self.num_output_tokens > 0

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )


def _random_seed() -> int:
    import random

    return random.getrandbits(62)


DRAFT_ON_DEVICE = -1  # placeholder in ``ScheduledSeq.draft_token_ids`` for a device draft


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: feed ``num_new_tokens`` tokens starting at
    ``seq.num_computed_tokens``, followed by ``draft_token_ids`` (verify only)."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    # The draft length L the policy decided for this step (``SpecDecision``): a decode entry
    # with L > 0 drafts L tokens (``draft_token_ids``, fewer near max_tokens) and verifies.
    draft_len: int = 0
    # What only the device reads (``engine.device_drafts.DeviceDrafts``: the ids while they are
    # still on the GPU, then ``draft_token_ids`` holds L ``DRAFT_ON_DEVICE`` placeholders; the
    # drafter's distributions; the event recorded after the drafting). None: host drafts only.
    drafts: DeviceDrafts | None = None
    # Filled by the runner when the step lands (``engine.logprobs``): the log-probs of the
    # tokens it produced, and of the prompt tokens this chunk scored.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    # Decode-ahead (``Scheduler.plan_ahead``): planned while this sequence's previous decode
    # step is still in flight, so its one input token is that step's sampled token, still on
    # the device (``StepPlan.prev_ids[ahead_index]``), at position ``ahead_position`` (one past
    # what the host knows). -1: an ordinary entry, its input tokens on the host.
    ahead_index: int = -1
    ahead_position: int = -1

    @property
    def is_ahead(self) -> bool:
        return self.ahead_index >= 0

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)

    def draft_ids(self) -> list[int]:
        """The draft ids on the host (a device sync when they are still on the device)."""
        if self.drafts is None or self.drafts.ids is None:
            return list(self.draft_token_ids)
        return self.drafts.ids.tolist()

    def truncate_drafts(self, n: int) -> None:
        """Keeps the first ``n`` drafts (ids, and their device half)."""
        n = max(n, 0)
        del self.draft_token_ids[n:]
        if self.drafts is not None:
            self.drafts.truncate(n)

    @property
    def samples(self) -> bool:
        """A step samples for this seq only when it reaches the end of the known tokens (an
        entry ahead of the host always does)."""
        if self.is_ahead:
            return True
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def sample_position(self) -> int:
        """The position of the token this entry samples (where ``samples``)."""
        if self.is_ahead:
            return self.ahead_position + 1
        return self.seq.num_tokens


@dataclass(frozen=True)
class SpecDecision:
    """One step's speculation decisions, as data: the policy's output, the scheduler's and the
    drafter's input. ``lens``: each speculating sequence's draft length L >= 1 (by seq_id);
    ``fused``: the drafted sequences verify inside the decode step (one target forward)
    instead of on the verify lane. Every decoding sequence reserves ``reserve`` draft slots
    (the longest L), so a verify batch, and the plain rows of a decode step fused with it, pad
    to one uniform length and replay a CUDA graph."""

    lens: Mapping[int, int] = field(default_factory=dict)
    fused: bool = False

    @property
    def reserve(self) -> int:
        return max(self.lens.values(), default=0)


NO_SPECULATION = SpecDecision()


@dataclass
class StepPlan:
    """Plain-data plan of one step, produced by a scheduler lane and executed by the runner."""

    lane: str  # "prefill" | "decode" | "verify" | "mixed"
    seqs: list[ScheduledSeq]
    fused: bool = False  # a decode step whose drafted entries verify inside it
    # Decode-ahead: the previous decode step's packed result, still on the device, where this
    # step's ahead entries read their input token (``ScheduledSeq.ahead_index``).
    prev_ids: torch.Tensor | None = None
    # A mixed step launched on the prefill lane: decode rows inside a prompt step in a backlog
    # (``lanes.backlog_fuse``); not the single lane's step.
    in_prompt_step: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.seqs)

    @property
    def carries_prompt(self) -> bool:
        """A decode step with a prompt chunk inside (``EngineConfig.prompt_in_decode_tokens``),
        or decode rows inside a prompt step (``in_prompt_step``): its time is not a decode
        step's (read before the step is folded back, while the chunk's sequence is
        prefilling)."""
        return (self.lane == "decode" or self.in_prompt_step) and any(
            s.seq.status is SeqStatus.PREFILLING for s in self.seqs
        )

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepResult:
    """What the runner hands back: new token ids per scheduled seq (same order as the plan).

    Prefill chunks that do not reach the end sample nothing (empty list); decode gives one
    token; verify gives the accepted drafts plus the bonus/resampled token.
    """

    token_ids: list[list[int]]
    num_drafted: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A delta for one request choice: new tokens and text since the last delta."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # One per new token when params.logprobs is set; on the first delta, when
    # params.prompt_logprobs is set, one per prompt token (the first is None).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class SpecListener:
    """What the engine reports to the speculation policy above it (``lanes.spec_policy``):
    sequences coming and going, and each verified entry's acceptance. The engine calls it and
    never imports the policy; the base class ignores it all (no policy attached)."""

    def request_added(self, seq: Sequence) -> None: ...
    def request_removed(self, seq: Sequence) -> None: ...
    def accepted(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None: ...


class Observer:
    """Hook through which the engine reports what it does. The base class ignores everything;
    ``serve.metrics`` subclasses it to export Prometheus metrics."""

    def lane_step(self, lane: str, seconds: float, num_tokens: int) -> None: ...
    def queue_depths(self, depths: dict[str, int]) -> None: ...
    def requests(self, num_running: int, num_waiting: int) -> None: ...
    def request_queued(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def request_finished(
        self, reason: str, e2e_seconds: float, num_prompt: int, num_generated: int
    ) -> None: ...
    def spec_tokens(self, num_drafted: int, num_accepted: int) -> None: ...
    def draft_length(self, draft_len: int) -> None: ...
    def spec_decision(self, reason: str, fused: bool, draft_len: int) -> None: ...
    def policy_decide(self, seconds: float) -> None: ...
    def drafter_temperature(self, temperature: float) -> None: ...
    def kv_cache(self, usage_ratio: float, num_free_blocks: int) -> None: ...
    def prefix_cache(self, num_queries: int, num_hits: int) -> None: ...
    def preemption(self) -> None: ...
    def decode_ahead(self) -> None: ...
    def prompt_in_decode(self) -> None: ...
    def decode_fused(self, num_rows: int) -> None: ...  # decode rows in a prompt step
    def kernel_compiled(self, name: str) -> None: ...  # a Triton compile after start-up
    def drafter_prompt_tokens(self, num_tokens: int) -> None: ...
    def engine_loop_lag(self, seconds: float) -> None: ...  # its own process only
