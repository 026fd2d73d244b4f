"""Shared types: sampling parameters (from ``sampling_params``), sequences, step plans, outputs
and the observer hook.

Plain data only: no tensors, no HTTP. Every layer may import this module.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# re-exported: the package imports them from here
from verifypd.sampling_params import (  # noqa: F401
    SEED_STRIDE,
    ParamError,
    SamplingParams,
    StructuredOutput,
    wrap_int64,
)

if TYPE_CHECKING:  # the runner-side half of a drafted entry; types stays torch-free
    import torch

    from verifypd.engine.device_drafts import DeviceDrafts


@dataclass
class TokenLogprob:
    """One token's raw log-probability and the ``top`` most likely tokens at its position
    (``(token_id, logprob)``, most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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
    # L > 0 was decided and the proposer found nothing to draft (a prompt lookup without a
    # match): the step decoded it plainly, and the policy hears of it (``SpecListener.no_drafts``).
    draft_missed: bool = False
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
        return (self.lane == "decode" or self.in_prompt_step) and self.has_prompt_chunk

    @property
    def has_prompt_chunk(self) -> bool:
        """A prompt chunk is in the step (read before it is folded back)."""
        return any(s.seq.status is SeqStatus.PREFILLING for s in self.seqs)

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


@dataclass
class RequestTiming:
    """Where one request's first token spent its time, as ``time.monotonic()`` stamps (one
    clock for every process on a host). A caller that passes one to ``generate`` gets the
    engine's stamps filled in; the HTTP front fills its own (``verifypd serve
    --log-request-timing``). None: not reached, or not on this path."""

    received: float | None = None  # the HTTP front began reading the request
    arrival: float | None = None  # handed to the engine: the arrival its queue rules read
    engine_first: float | None = None  # the engine process sent the first delta (a child only)
    first_out: float | None = None  # the caller's iterator got the first delta
    first_sent: float | None = None  # the first content chunk went to the client's socket
    done: float | None = None  # the response ended


class SpecListener:
    """What the engine reports to the speculation policy above it (``lanes.spec_policy``):
    sequences coming and going, and each verified entry's acceptance. The engine calls it and
    never imports the policy; the base class ignores it all (no policy attached)."""

    def request_added(self, seq: Sequence) -> None: ...
    def request_removed(self, seq: Sequence) -> None: ...
    def accepted(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None: ...
    def no_drafts(self, seq: Sequence) -> None: ...


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
    def draft_missed(self) -> None: ...  # a row given L > 0 found nothing to draft
    def draft_length(self, draft_len: int) -> None: ...
    def spec_decision(self, reason: str, fused: bool, draft_len: int) -> None: ...
    def policy_decide(self, seconds: float) -> None: ...
    def drafter_temperature(self, temperature: float) -> None: ...
    def kv_cache(self, usage_ratio: float, num_free_blocks: int) -> None: ...
    def prefix_cache(self, num_queries: int, num_hits: int) -> None: ...
    def preemption(self) -> None: ...
    def decode_ahead(self) -> None: ...
    def prompt_ahead(self) -> None: ...  # a prompt step launched behind the one in flight
    def prompt_in_decode(self) -> None: ...
    def decode_fused(self, num_rows: int) -> None: ...  # decode rows in a prompt step
    def kernel_compiled(self, name: str) -> None: ...  # a Triton compile after start-up
    def drafter_prompt_tokens(self, num_tokens: int) -> None: ...
    def engine_loop_lag(self, seconds: float) -> None: ...  # its own process only
