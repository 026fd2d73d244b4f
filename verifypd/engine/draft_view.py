"""The drafter's view of a target sequence (``DraftView``): shared by the proposer
(``speculative``), its catch-up (``draft_catch_up``) and its prompt following (``draft_follow``).

With a context window (``SpecConfig.draft_window``) a view of a long prompt leaves out the
prompt's middle: it holds the prompt's first ``draft_window_sink`` tokens, then its last
``draft_window`` tokens and every token after them, numbered from 0 in the drafter's KV (RoPE
scores depend only on the distance between positions, so the window's own distances are the
sequence's; only the jump from the sink to the window shrinks, as in StreamingLLM). The drafter
then never feeds the middle: its pass over a long prompt costs at most sink + window tokens.
Drafts stay drafts: the target verifies them against the whole context, so output is lossless
whatever the window; only acceptance can fall.
"""

from __future__ import annotations

import torch

from verifypd.engine.sampler import SamplingTensors
from verifypd.types import Sequence

_DRAFT_SEED_SALT = 0x5DEECE66D  # drafter noise must not reuse the target's sampling stream


def window_skip(seq: Sequence, window: int | None, sink: int) -> int:
    """Prompt tokens a view of ``seq`` leaves out: those between the first ``sink`` and the
    last ``window`` (0 without a window, or for a prompt no longer than sink + window)."""
    if window is None:
        return 0
    return max(0, seq.num_prompt_tokens - sink - window)


def draft_sampling(
    views: list[DraftView], temps: list[float], positions: list[int], device: torch.device
) -> SamplingTensors:
    """The views' drafter sampling parameters at ``temps`` (their requests' top-k and top-p,
    their drafter seeds), copied to the device once."""
    return SamplingTensors.build(
        temperature=temps,
        top_k=[v.params.top_k for v in views],
        top_p=[v.params.top_p for v in views],
        seeds=[v.seed for v in views],
        positions=positions,
        device=device,
    )


class DraftView:
    """The drafter's copy of a target sequence: same tokens (but a window's left-out middle,
    ``skip`` tokens after the first ``sink``), its own KV progress and blocks. Its counts and
    positions are its own; ``local`` maps a sequence's token count onto them."""

    def __init__(self, seq: Sequence, window: int | None = None, sink: int = 0) -> None:
        self.seq_id = seq.seq_id
        self.sink = sink
        self.skip = window_skip(seq, window, sink)
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.params = seq.params
        self.seed = seq.seed ^ _DRAFT_SEED_SALT
        self.ready = None  # CUDA event after a catch-up behind a prompt chunk (``follow_iter``)
        # Forwards behind its prompt chunks queued or being enqueued in pieces (``follow_iter``),
        # and the prompt length they feed it up to: while any is, nothing else drafts for it.
        self.following = 0
        self.follow_end = 0
        # The first drafted position whose verify has not landed: the KV from there on is the
        # drafts'. ``verified`` keeps the accepted ones; without it none is kept.
        self.draft_start: int | None = None
        # The drafter temperature of its last proposal (0: greedy): a round chained behind that
        # proposal's verify drafts at it (``chained_drafts``).
        self.draft_temp = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def local(self, n: int) -> int:
        """The view's count of the sequence's first ``n`` tokens."""
        if n <= self.sink:
            return n
        return max(self.sink, n - self.skip)

    def seq_end(self, k: int) -> int:
        """A sequence's token count whose ``local`` count is the view's ``k`` (the smallest)."""
        return k if k <= self.sink else k + self.skip

    def ids_of(self, token_ids: list[int]) -> list[int]:
        """The view's tokens of a sequence's ``token_ids`` (the middle left out; without a
        window ``token_ids`` itself, not a copy: the callers map it to the drafter's ids)."""
        if not self.skip:
            return token_ids
        return token_ids[: self.sink] + token_ids[self.sink + self.skip :]

    def following_now(self) -> bool:
        """A forward behind its prompt chunks is being enqueued, or has not run yet on the
        GPU: drafting for it now would make the decode stream wait behind the follow stream,
        which runs below every lane. Once the GPU has passed it the event is dropped (nothing
        need wait for it), so a request that never drafts is not asked about on every step."""
        if self.following:
            return True
        if self.ready is not None and self.ready.query():
            self.ready = None
        return self.ready is not None
