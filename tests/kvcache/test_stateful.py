"""Hypothesis state machine over random cache verbs, checked against a model.

The model keeps each live sequence's tokens, computed count and block table, plus a fake
physical KV store (block, offset) -> token id written there. After every step:
``check_integrity(live_tables)`` (ref counts == occurrences), every computed position of every
table reads back its own token from the fake store (so no block was shared without
copy-on-write, evicted while in use, or handed out twice), every registered block's KV holds
the tokens it is registered with (so a prefix hit is never stale), and every block handed out
fresh (allocate / copy-on-write destination) was in no other live table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from verifypd.kvcache import KVCacheManager

BS = 4
NUM_BLOCKS = 12
MAX_SEQS = 6  # keeps the pool under pressure without making every allocation fail
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=14)


@dataclass
class SeqModel:
    tokens: list[int]
    num_computed: int = 0
    table: list[int] = field(default_factory=list)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS)
        self.seqs: dict[int, SeqModel] = {}
        self.kv: dict[tuple[int, int], int] = {}  # fake KV: (block, offset) -> token id
        self.next_id = 0

    # ----- helpers ------------------------------------------------------------------------

    def _pick(self, i: int) -> tuple[int, SeqModel]:
        key = sorted(self.seqs)[i % len(self.seqs)]
        return key, self.seqs[key]

    def _snapshot(self) -> tuple:
        a = self.m.allocator
        refs = tuple(a.refcount(b) for b in range(NUM_BLOCKS))
        return a.free_block_ids(), self.m.prefix_cache.evictable_block_ids(), refs

    def _assert_fresh(self, owner: SeqModel, blocks: list[int]) -> None:
        for other in self.seqs.values():
            if other is not owner:
                shared = set(blocks) & set(other.table)
                assert not shared, f"fresh blocks {shared} already in another live table"

    def _add(self, tokens: list[int], use_hit: bool, prefill: bool) -> None:
        hit = self.m.match_prefix(tokens) if use_hit else []
        seq = SeqModel(tokens, num_computed=len(hit) * BS)
        before = self._snapshot()
        if not self.m.allocate(seq.table, len(tokens), hit):
            assert seq.table == [] and self._snapshot() == before
            return
        assert seq.table[: len(hit)] == hit
        self._assert_fresh(seq, seq.table[len(hit) :])
        self.seqs[self.next_id] = seq
        self.next_id += 1
        if prefill:
            self._compute(seq, len(tokens))

    def _compute(self, seq: SeqModel, n: int) -> None:
        """Write the KV of the next ``n`` tokens (copy-on-write first), then cache blocks."""
        start, end = seq.num_computed, min(seq.num_computed + n, len(seq.tokens))
        before = self._snapshot()
        pairs = self.m.copy_on_write(seq.table, start, end)
        if pairs is None:
            assert self._snapshot() == before
            return
        self._assert_fresh(seq, [dst for _, dst in pairs])
        for src, dst in pairs:
            for off in range(BS):
                self.kv.pop((dst, off), None)
                if (src, off) in self.kv:
                    self.kv[dst, off] = self.kv[src, off]
        for pos in range(start, end):
            self.kv[seq.table[pos // BS], pos % BS] = seq.tokens[pos]
        seq.num_computed = end
        self.m.cache_blocks(seq.table, seq.tokens, seq.num_computed)

    # ----- rules --------------------------------------------------------------------------

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(tokens=tokens_st, use_hit=st.booleans(), prefill=st.booleans())
    def add_seq(self, tokens: list[int], use_hit: bool, prefill: bool) -> None:
        self._add(tokens, use_hit, prefill)

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_SEQS)
    @rule(i=st.integers(0, 99), keep=st.integers(0, 16), suffix=tokens_st, prefill=st.booleans())
    def add_seq_sharing_prefix(self, i: int, keep: int, suffix: list[int], prefill: bool) -> None:
        _, src = self._pick(i)
        self._add(src.tokens[:keep] + suffix, use_hit=True, prefill=prefill)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), n=st.integers(0, 16))
    def compute(self, i: int, n: int) -> None:
        self._compute(self._pick(i)[1], n)

    @precondition(lambda self: self.seqs)
    @rule(
        i=st.integers(0, 99),
        new=st.lists(st.integers(0, 1), min_size=1, max_size=6),
        compute_now=st.booleans(),
    )
    def append(self, i: int, new: list[int], compute_now: bool) -> None:
        """A decode / verify step: room for new tokens, then (maybe) their KV is written."""
        _, seq = self._pick(i)
        old_len = len(seq.table)
        before = self._snapshot()
        if not self.m.allocate(seq.table, len(seq.tokens) + len(new)):
            assert len(seq.table) == old_len and self._snapshot() == before
            return
        self._assert_fresh(seq, seq.table[old_len:])
        seq.tokens.extend(new)
        if compute_now:
            self._compute(seq, len(seq.tokens))

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_SEQS)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        _, seq = self._pick(i)
        child = SeqModel(list(seq.tokens), seq.num_computed, self.m.fork(seq.table))
        assert child.table == seq.table
        self.seqs[self.next_id] = child
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), drop=st.integers(0, 10))
    def truncate(self, i: int, drop: int) -> None:
        _, seq = self._pick(i)
        n = max(0, len(seq.tokens) - drop)
        self.m.truncate(seq.table, n)
        del seq.tokens[n:]
        seq.num_computed = min(seq.num_computed, n)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        key, seq = self._pick(i)
        self.m.free(seq.table)
        assert seq.table == []
        del self.seqs[key]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), suffix=tokens_st, prefill=st.booleans())
    def preempt_and_readmit(self, i: int, suffix: list[int], prefill: bool) -> None:
        """Free a sequence, then admit it again (grown) through the prefix cache."""
        key, seq = self._pick(i)
        self.m.free(seq.table)
        del self.seqs[key]
        self._add(seq.tokens + suffix, use_hit=True, prefill=prefill)

    @rule(i=st.integers(0, 99), keep=st.integers(0, 20), suffix=st.lists(st.integers(0, 1)))
    def match_prefix_is_correct(self, i: int, keep: int, suffix: list[int]) -> None:
        tokens = (self._pick(i)[1].tokens[:keep] if self.seqs else []) + suffix
        hit = self.m.match_prefix(tokens)
        assert len(hit) <= max(0, (len(tokens) - 1) // BS)
        for i, b in enumerate(hit):  # a hit's KV holds exactly these tokens
            assert [self.kv.get((b, off)) for off in range(BS)] == tokens[i * BS : (i + 1) * BS]

    @rule(dice=st.integers(0, 7))
    def reset_prefix_cache(self, dice: int) -> None:
        if dice != 5:  # rare: a reset wipes the state the other rules build up
            return
        self.m.reset_prefix_cache()
        assert self.m.prefix_cache.num_evictable == 0

    # ----- invariants ---------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity([s.table for s in self.seqs.values()])
        num_used = len({b for s in self.seqs.values() for b in s.table})
        assert self.m.num_free_blocks == NUM_BLOCKS - num_used
        assert self.m.usage == num_used / NUM_BLOCKS

    @invariant()
    def tables_cover_tokens_and_hold_their_kv(self) -> None:
        for seq in self.seqs.values():
            assert len(seq.table) == -(-len(seq.tokens) // BS)
            for pos in range(seq.num_computed):
                assert self.kv.get((seq.table[pos // BS], pos % BS)) == seq.tokens[pos]

    @invariant()
    def registered_blocks_hold_their_tokens(self) -> None:
        for b in range(NUM_BLOCKS):
            entry = self.m.prefix_cache.entry(b)
            if entry is not None:
                assert tuple(self.kv.get((b, off)) for off in range(BS)) == entry.token_ids

    @invariant()
    def shared_blocks_sit_at_the_same_position(self) -> None:
        where: dict[int, int] = {}
        for seq in self.seqs.values():
            for idx, b in enumerate(seq.table):
                assert where.setdefault(b, idx) == idx, f"block {b} at two positions"


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
