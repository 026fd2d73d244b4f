"""Exact-block-id tests of KVCacheManager (block_size 4 throughout)."""

import pytest

from verifypd.kvcache import KVCacheManager
from verifypd.kvcache import prefix_cache as prefix_cache_mod

BS = 4


def _prefilled(m: KVCacheManager, prompt: list[int]) -> list[int]:
    """Allocate a table for ``prompt``, compute all of it and register its full blocks."""
    table: list[int] = []
    assert m.allocate(table, len(prompt))
    m.cache_blocks(table, prompt, len(prompt))
    return table


def _state(m: KVCacheManager) -> tuple:
    a, c = m.allocator, m.prefix_cache
    refs = tuple(a.refcount(b) for b in range(m.num_blocks))
    return a.free_block_ids(), c.evictable_block_ids(), c.num_registered, refs


def test_allocate_extends_table_in_place():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    table: list[int] = []
    assert m.num_blocks_needed(table, 5) == 2
    assert m.allocate(table, 5)
    assert table == [0, 1]
    assert m.allocate(table, 8)  # already covered
    assert table == [0, 1]
    assert m.allocate(table, 9)
    assert table == [0, 1, 2]
    assert m.num_free_blocks == 7
    assert m.usage == pytest.approx(0.3)
    m.check_integrity([table])


def test_allocate_failure_changes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = _prefilled(m, list(range(9)))  # [0, 1, 2]; blocks 0, 1 registered
    m.free(a)
    b: list[int] = []
    assert m.allocate(b, 4)
    before = _state(m)
    c: list[int] = []
    assert not m.can_allocate(c, 4 * BS + 1)
    assert not m.allocate(c, 4 * BS + 1)
    assert c == []
    assert not m.allocate(b, 5 * BS)
    assert b == [3]
    assert _state(m) == before
    m.check_integrity([b])


def test_free_then_same_prompt_hits_same_blocks():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    a = _prefilled(m, prompt)
    assert a == [0, 1, 2]
    m.free(a)
    assert a == []
    # Registered blocks 0, 1 are cached; partial block 2 went back to the free list.
    assert m.allocator.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2]
    assert m.prefix_cache.evictable_block_ids() == [1, 0]
    assert m.num_free_blocks == 10 and m.usage == 0.0
    hit = m.match_prefix(prompt)
    assert hit == [0, 1]
    assert m.num_prefix_query_tokens == 10 and m.num_prefix_hit_tokens == 8
    b: list[int] = []
    assert m.num_blocks_needed(b, len(prompt), hit) == 1
    assert m.allocate(b, len(prompt), hit)
    assert b == [0, 1, 3]
    assert m.prefix_cache.evictable_block_ids() == []
    assert m.allocator.refcount(0) == m.allocator.refcount(1) == 1
    m.check_integrity([b])


def test_hit_on_blocks_in_use_shares_them():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(12)) + [99]
    a = _prefilled(m, prompt)
    hit = m.match_prefix(list(range(12)) + [50, 51])
    assert hit == [0, 1, 2]
    b: list[int] = []
    assert m.allocate(b, 14, hit)
    assert b == [0, 1, 2, 4]
    assert [m.allocator.refcount(x) for x in (0, 1, 2, 3, 4)] == [2, 2, 2, 1, 1]
    m.check_integrity([a, b])
    m.free(a)
    assert m.prefix_cache.evictable_block_ids() == []  # still referenced by b
    assert m.allocator.free_block_ids()[-1] == 3
    m.check_integrity([b])


def test_match_prefix_leaves_at_least_one_token():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    m.free(_prefilled(m, prompt))
    assert m.match_prefix(prompt) == [0]
    assert m.match_prefix(prompt + [8]) == [0, 1]
    assert m.match_prefix(prompt[:4]) == []
    assert m.match_prefix([]) == []
    assert m.match_prefix([7] + prompt) == []


def test_partial_and_uncomputed_blocks_are_never_cached():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(7))
    table: list[int] = []
    assert m.allocate(table, len(prompt))
    m.cache_blocks(table, prompt, 3)  # block 0 not fully computed
    assert m.prefix_cache.num_registered == 0
    m.cache_blocks(table, prompt, 7)  # block 1 is partial
    assert m.prefix_cache.num_registered == 1
    assert m.prefix_cache.is_registered(0) and not m.prefix_cache.is_registered(1)
    m.free(table)
    assert m.match_prefix(prompt + [7, 8]) == [0]
    assert m.allocator.free_block_ids()[-1] == 1


def test_cache_blocks_is_incremental_and_idempotent(monkeypatch):
    calls = []
    real = prefix_cache_mod.block_hash

    def counting_hash(parent, tokens):
        calls.append(tokens)
        return real(parent, tokens)

    monkeypatch.setattr(prefix_cache_mod, "block_hash", counting_hash)
    m = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(20))
    table: list[int] = []
    assert m.allocate(table, 20)
    for num_computed in range(21):
        m.cache_blocks(table, tokens, num_computed)
        m.cache_blocks(table, tokens, num_computed)
    assert calls == [tuple(range(i, i + 4)) for i in range(0, 20, 4)]  # each block hashed once
    assert m.prefix_cache.num_registered == 5


def test_duplicate_content_stays_unregistered_and_is_freed():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    a = _prefilled(m, prompt)  # [0, 1, 2], registers 0, 1
    b = _prefilled(m, prompt)  # no match_prefix: [3, 4, 5], same hashes -> unregistered
    assert b == [3, 4, 5]
    assert not m.prefix_cache.is_registered(3) and not m.prefix_cache.is_registered(4)
    m.free(b)
    assert m.prefix_cache.evictable_block_ids() == []
    assert m.allocator.free_block_ids()[-3:] == [5, 4, 3]
    m.free(a)
    assert m.prefix_cache.evictable_block_ids() == [1, 0]
    m.check_integrity([])


def test_forced_hash_collision_gives_a_miss_not_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(prefix_cache_mod, "block_hash", lambda parent, tokens: 42)
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = _prefilled(m, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Block 0 holds hash 42; block 1 collides with it and stays unregistered.
    assert m.prefix_cache.is_registered(0) and not m.prefix_cache.is_registered(1)
    assert m.match_prefix([1, 2, 3, 4, 0]) == [0]
    assert m.match_prefix([9, 9, 9, 9, 0]) == []  # same hash, other tokens
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [0]
    b = _prefilled(m, [9, 9, 9, 9, 0])
    assert not m.prefix_cache.is_registered(b[0])
    m.check_integrity([a, b])


def test_lru_evicts_least_recent_sequence_tail_first():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = _prefilled(m, list(range(8)))  # [0, 1]
    b = _prefilled(m, list(range(50, 58)))  # [2, 3]
    m.free(a)
    m.free(b)
    assert m.prefix_cache.evictable_block_ids() == [1, 0, 3, 2]
    c: list[int] = []
    assert m.allocate(c, 3 * BS)  # free list [4, 5], then evicts 1
    assert c == [4, 5, 1]
    assert m.match_prefix(list(range(9))) == [0]  # block 1 is gone, block 0 still hits
    assert m.allocate(c, 5 * BS)
    assert c == [4, 5, 1, 0, 3]
    assert m.match_prefix(list(range(50, 59))) == [2]  # block 3 is gone, block 2 still hits
    assert m.prefix_cache.evictable_block_ids() == [2]
    m.check_integrity([c])


def test_hit_refreshes_lru_position():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = _prefilled(m, list(range(4)))  # [0]
    b = _prefilled(m, list(range(10, 14)))  # [1]
    m.free(a)
    m.free(b)
    assert m.prefix_cache.evictable_block_ids() == [0, 1]
    hit = m.match_prefix(list(range(5)))
    c: list[int] = []
    assert m.allocate(c, 4, hit) and c == [0]
    m.free(c)
    assert m.prefix_cache.evictable_block_ids() == [1, 0]


def test_revived_hit_blocks_do_not_count_as_room():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    base = list(range(8))
    m.free(_prefilled(m, base + [8]))  # [0, 1, 2]; 0, 1 cached; free list [3, 2]
    assert m.num_free_blocks == 4
    long_prompt = base + list(range(100, 112))  # 5 blocks: 2 hit + 3 fresh > 2 free
    hit = m.match_prefix(long_prompt)
    assert hit == [0, 1]
    before = _state(m)
    table: list[int] = []
    assert m.num_blocks_needed(table, len(long_prompt), hit) == 3
    assert not m.can_allocate(table, len(long_prompt), hit)
    assert not m.allocate(table, len(long_prompt), hit)
    assert table == [] and _state(m) == before
    assert m.allocate(table, 16, hit)
    assert table == [0, 1, 3, 2]
    assert m.num_free_blocks == 0 and m.usage == 1.0


def test_stale_prefix_hit_is_rejected():
    m = KVCacheManager(num_blocks=2, block_size=BS)
    m.free(_prefilled(m, list(range(5))))  # block 0 cached
    hit = m.match_prefix(list(range(5)))
    assert hit == [0]
    other: list[int] = []
    assert m.allocate(other, 8)  # evicts block 0
    with pytest.raises(ValueError, match="stale"):
        m.allocate([], 5, hit)
    with pytest.raises(ValueError):
        m.allocate([1], 5, [0])


def test_fork_and_copy_on_write_exact_pairs():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    parent: list[int] = []
    assert m.allocate(parent, 10)  # [0, 1, 2]
    child = m.fork(parent)
    assert child == [0, 1, 2] and child is not parent
    assert [m.allocator.refcount(b) for b in (0, 1, 2)] == [2, 2, 2]
    m.check_integrity([parent, child])
    # The child writes token 10 (block 2): only that shared block is copied.
    assert m.copy_on_write(child, 10, 11) == [(2, 3)]
    assert child == [0, 1, 3] and parent == [0, 1, 2]
    assert m.allocator.refcount(2) == 1 and m.allocator.refcount(3) == 1
    assert m.copy_on_write(parent, 10, 11) == []  # no longer shared
    # A range spanning two shared blocks copies both, in table order.
    assert m.copy_on_write(child, 2, 6) == [(0, 4), (1, 5)]
    assert child == [4, 5, 3]
    assert m.copy_on_write(child, 0, 0) == []
    m.check_integrity([parent, child])


def test_copy_on_write_without_room_changes_nothing():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    parent: list[int] = []
    assert m.allocate(parent, 8)  # [0, 1]
    child = m.fork(parent)
    before = _state(m)
    assert m.copy_on_write(child, 0, 8) is None  # needs 2, one free
    assert child == [0, 1] and _state(m) == before
    assert m.copy_on_write(child, 4, 8) == [(1, 2)]
    m.check_integrity([parent, child])


def test_truncate_releases_tail_blocks():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    table: list[int] = []
    assert m.allocate(table, 13)  # [0, 1, 2, 3]
    m.truncate(table, 6)
    assert table == [0, 1]
    assert m.allocator.free_block_ids() == [4, 5, 3, 2]
    m.truncate(table, 8)  # nothing beyond 2 blocks
    assert table == [0, 1]
    m.truncate(table, 0)
    assert table == []
    assert m.num_free_blocks == 6
    m.check_integrity([table])


def test_truncate_inside_a_registered_block_unregisters_it():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    table = _prefilled(m, tokens)  # [0, 1, 2], all registered
    m.truncate(table, 6)  # block 1 is cut and will be rewritten; block 2 stays cached
    assert table == [0, 1]
    assert not m.prefix_cache.is_registered(1)
    assert m.prefix_cache.evictable_block_ids() == [2]
    new_tokens = tokens[:6] + [70, 71]
    m.cache_blocks(table, new_tokens, 8)
    assert m.match_prefix(new_tokens + [0]) == [0, 1]
    assert m.match_prefix(tokens + [0]) == [0]
    m.check_integrity([table])


def test_writing_into_a_formerly_shared_registered_block_unregisters_it():
    # Found by the state machine: truncate into a shared cached block (which keeps its hash
    # for the other holder), the other holder leaves, then the block is written in place.
    m = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(8))
    a = _prefilled(m, tokens)  # [0, 1], both registered
    b = m.fork(a)
    m.truncate(b, 6)
    assert m.prefix_cache.is_registered(1)  # a still holds block 1 with these tokens
    m.free(a)
    assert m.copy_on_write(b, 6, 7) == []  # ref 1 now: written in place...
    assert not m.prefix_cache.is_registered(1)  # ...so its old hash must go
    assert m.match_prefix(tokens + [0]) == [0]
    m.check_integrity([b])


def test_usage_and_free_counts_track_cached_blocks():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = _prefilled(m, list(range(16)))  # 4 blocks, all registered
    assert (m.num_free_blocks, m.usage) == (4, 0.5)
    m.free(a)
    assert (m.num_free_blocks, m.usage) == (8, 0.0)
    assert m.allocator.num_free_blocks == 4 and m.prefix_cache.num_evictable == 4
    m.reset_prefix_cache()
    assert m.allocator.num_free_blocks == 8 and m.prefix_cache.num_evictable == 0
    assert m.match_prefix(list(range(17))) == []
    m.check_integrity([])


def test_reset_keeps_blocks_in_use():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = _prefilled(m, list(range(8)))
    m.free(_prefilled(m, list(range(20, 28))))
    m.reset_prefix_cache()
    assert m.match_prefix(list(range(9))) == [0, 1]
    assert m.match_prefix(list(range(20, 29))) == []
    m.check_integrity([a])


def test_prefix_caching_disabled():
    m = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    m.free(_prefilled(m, prompt))
    assert m.prefix_cache.num_registered == 0
    assert m.allocator.num_free_blocks == 6
    assert m.match_prefix(prompt) == []
    assert m.num_prefix_query_tokens == 0


def test_check_integrity_reports_wrong_live_tables():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a: list[int] = []
    assert m.allocate(a, 8)
    m.check_integrity([a])
    with pytest.raises(AssertionError, match="block 1 has ref count 1 but appears 0"):
        m.check_integrity([a[:1]])
    with pytest.raises(AssertionError, match="appears 2 times"):
        m.check_integrity([a, a[:1]])
    m.allocator._ref_counts[5] = 1  # corrupt: referenced but on the free list
    with pytest.raises(AssertionError, match="block 5"):
        m.check_integrity()


def test_salted_prompts_share_blocks_only_within_their_salt():
    """vLLM's cache_salt: the same tokens cached under one salt are a miss under another salt
    and unsalted, and a hit under the same salt; an unsalted block is a miss for a salted
    prompt. A hit found under one salt cannot be allocated under another."""
    m = KVCacheManager(num_blocks=12, block_size=BS)
    prompt = list(range(9))  # 2 full blocks + 1 token
    a: list[int] = []
    assert m.allocate(a, len(prompt), salt="tenant-a")
    m.cache_blocks(a, prompt, len(prompt), salt="tenant-a")
    m.free(a)
    assert m.match_prefix(prompt) == []
    assert m.match_prefix(prompt, "tenant-b") == []
    hit = m.match_prefix(prompt, "tenant-a")
    assert hit == [0, 1]
    with pytest.raises(ValueError, match="stale"):
        m.allocate([], len(prompt), hit, salt="tenant-b")
    b: list[int] = []
    assert m.allocate(b, len(prompt), hit, salt="tenant-a")
    assert b[:2] == [0, 1]
    m.free(b)
    c = _prefilled(m, prompt)  # unsalted: blocks of its own
    assert set(c).isdisjoint({0, 1})
    unsalted = c[:2]
    m.free(c)
    assert m.match_prefix(prompt) == unsalted
    assert m.match_prefix(prompt, "tenant-a") == [0, 1]
    assert m.match_prefix(prompt, "tenant-c") == []
    m.check_integrity([])


def test_salt_roots_are_stable_and_distinct():
    root = prefix_cache_mod.root_hash
    assert root(None) == prefix_cache_mod.ROOT_HASH
    assert root("a") == root("a") != root("b")
    assert prefix_cache_mod.ROOT_HASH not in {root(s) for s in ("", "a", "b", "x" * 1000)}
