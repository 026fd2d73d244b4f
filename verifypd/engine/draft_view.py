"""The drafter's view of a target sequence (``DraftView``): shared by the proposer
(``speculative``), its catch-up (``draft_catch_up``) and its prompt following (``draft_follow``).
"""

from __future__ import annotations

from verifypd.types import Sequence

_DRAFT_SEED_SALT = 0x5DEECE66D  # drafter noise must not reuse the target's sampling stream


class DraftView:
    """The drafter's copy of a target sequence: same tokens, its own KV progress and blocks."""

    def __init__(self, seq: Sequence) -> None:
        self.seq_id = seq.seq_id
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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
