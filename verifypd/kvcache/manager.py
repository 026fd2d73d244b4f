"""KV cache manager: block tables over a ref-counted allocator, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

from verifypd.kvcache.allocator import BlockAllocator
from verifypd.kvcache.integrity import check_integrity
from verifypd.kvcache.prefix_cache import PrefixCache, root_hash


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every KV block of one pool. Callers own block tables (plain ``list[int]``) and pass
    them in; every verb edits the table in place and answers "no room" with False/None,
    changing nothing.

    Block states: free (allocator free list), referenced (ref > 0, in live tables), or cached
    (ref 0, registered in the prefix cache, evictable in LRU order).
    ``_content_hash`` remembers the chained hash of every block that ``cache_blocks`` saw full
    and computed (registered or not), so registration is incremental; the memo is dropped when
    the block's contents may change (freed, evicted, cut by ``truncate`` or rewritten in
    place after ``copy_on_write``).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.prefix_cache = PrefixCache()
        self._content_hash: dict[int, int] = {}
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: the free list plus evictable cached blocks."""
        return self.allocator.num_free_blocks + self.prefix_cache.num_evictable

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live tables."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    # ----- prefix cache -------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Longest run of cached full blocks matching a prefix of ``token_ids`` (cached under
        the same ``salt``). Takes no references. At most ``(len(token_ids) - 1) // block_size``
        blocks, so at least one token is left to compute (its logits are needed). [] when
        caching is off."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        blocks: list[int] = []
        parent = root_hash(salt)
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.prefix_cache.hash_block(parent, tokens)
            block_id = self.prefix_cache.lookup(h, parent, tokens)
            if block_id is None:
                break
            blocks.append(block_id)
            parent = h
        self.num_prefix_query_tokens += len(token_ids)
        self.num_prefix_hit_tokens += len(blocks) * bs
        return blocks

    def cache_blocks(
        self,
        block_table: list[int],
        token_ids: list[int],
        num_computed_tokens: int,
        salt: str | None = None,
    ) -> None:
        """Register every full block of ``block_table`` whose tokens are all computed under its
        chained hash (block 0's chained from ``salt``'s root). Incremental: only blocks not seen
        before are hashed. A block whose hash is already held by another block stays
        unregistered (and is freed normally later)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids), len(block_table) * bs) // bs
        start = num_full
        while start > 0 and block_table[start - 1] not in self._content_hash:
            start -= 1
        if start >= num_full:
            return
        parent = self._content_hash[block_table[start - 1]] if start else root_hash(salt)
        cache, memo = self.prefix_cache, self._content_hash  # hundreds of blocks a prompt step
        for i in range(start, num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = cache.hash_block(parent, tokens)
            memo[block_table[i]] = h
            cache.insert(block_table[i], h, parent, tokens)
            parent = h

    def reset_prefix_cache(self) -> None:
        """Drop every evictable cached block back to the free list."""
        for b in self.prefix_cache.evict_all():
            self._content_hash.pop(b, None)
            self.allocator.release([b])

    # ----- allocation ---------------------------------------------------------------------

    def num_blocks_needed(
        self, block_table: list[int], num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> int:
        """Fresh blocks ``allocate`` would take to cover ``num_tokens`` positions."""
        return max(0, _cdiv(num_tokens, self.block_size) - len(block_table) - len(cached_blocks))

    def can_allocate(
        self, block_table: list[int], num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """True if ``allocate`` with the same arguments would succeed."""
        needed = self.num_blocks_needed(block_table, num_tokens, cached_blocks)
        return needed <= self._room(cached_blocks)

    def allocate(
        self,
        block_table: list[int],
        num_tokens: int,
        cached_blocks: Sequence[int] = (),
        salt: str | None = None,
    ) -> bool:
        """Extend ``block_table`` in place to cover ``num_tokens`` positions. ``cached_blocks``
        (a fresh ``match_prefix`` result under the same ``salt``; only with an empty table) are
        taken first, then new blocks from the free list, then by evicting LRU cached blocks.
        False: nothing changed."""
        if not cached_blocks and len(block_table) * self.block_size >= num_tokens:
            return True  # already covered: every decode step of every sequence asks this
        if cached_blocks and block_table:
            raise ValueError("cached_blocks may only be given for an empty block table")
        self._check_prefix_hit(cached_blocks, salt)
        needed = self.num_blocks_needed(block_table, num_tokens, cached_blocks)
        if needed > self._room(cached_blocks):
            return False
        for b in cached_blocks:  # revive before evicting, so a hit is never evicted
            if self.prefix_cache.is_parked(b):
                self.prefix_cache.unpark(b)
        self.allocator.incref(list(cached_blocks))
        block_table.extend(cached_blocks)
        block_table.extend(self._take_fresh(needed))
        return True

    def free(self, block_table: list[int]) -> None:
        """Drop one reference of every block, tail first (so the LRU evicts a sequence's last
        blocks before its first ones), and clear the table in place."""
        self._release(block_table[::-1])
        block_table.clear()

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Speculative rollback: keep the blocks covering ``num_tokens`` positions, in place."""
        keep = _cdiv(num_tokens, self.block_size)
        if num_tokens % self.block_size and keep <= len(block_table):
            self._forget_contents(block_table[keep - 1])
        self._release(block_table[keep:][::-1])  # tail first, as in free
        del block_table[keep:]

    def fork(self, block_table: list[int]) -> list[int]:
        """A child table sharing every block of ``block_table`` (each ref +1)."""
        self.allocator.incref(block_table)
        return list(block_table)

    def copy_on_write(
        self, block_table: list[int], start_token: int, end_token: int
    ) -> list[tuple[int, int]] | None:
        """Before tokens [start_token, end_token) are written: replace every shared block
        (ref > 1) the range touches by a fresh one, and unregister any cached content of the
        unshared blocks it touches (they are overwritten in place). Returns the (src, dst)
        pairs whose KV the runner must copy, or None (nothing changed) if there is no room."""
        first = start_token // self.block_size
        last = min(_cdiv(end_token, self.block_size), len(block_table))
        shared = [i for i in range(first, last) if self.allocator.refcount(block_table[i]) > 1]
        if len(shared) > self.num_free_blocks:
            return None
        for i in range(first, last):  # unshared blocks are written in place: drop any hash
            self._forget_contents(block_table[i])
        pairs = []
        for i, dst in zip(shared, self._take_fresh(len(shared)), strict=True):
            pairs.append((block_table[i], dst))
            self.allocator.decref([block_table[i]])  # ref was > 1: stays referenced
            block_table[i] = dst
        return pairs

    def check_integrity(self, live_tables: list[list[int]] | None = None) -> None:
        """Raise AssertionError unless the block states, ref counts and cache maps agree (and
        each ref count equals the block's occurrences across ``live_tables``, if given)."""
        check_integrity(self.allocator, self.prefix_cache, self._content_hash, live_tables)

    # ----- internals ----------------------------------------------------------------------

    def _room(self, cached_blocks: Sequence[int]) -> int:
        # Parked blocks about to be revived are not room for fresh blocks.
        num_revived = sum(1 for b in cached_blocks if self.prefix_cache.is_parked(b))
        return self.num_free_blocks - num_revived

    def _take_fresh(self, n: int) -> list[int]:
        """n blocks with ref 1: free list first, then evicted LRU cached blocks. Caller has
        checked that there is room."""
        block_ids = self.allocator.allocate(min(n, self.allocator.num_free_blocks))
        assert block_ids is not None
        for _ in range(n - len(block_ids)):
            b = self.prefix_cache.evict()
            self._content_hash.pop(b, None)
            self.allocator.incref([b])
            block_ids.append(b)
        return block_ids

    def _release(self, block_ids: list[int]) -> None:
        """Drop one ref of each; a block reaching 0 is parked if registered, else freed."""
        for b in self.allocator.decref(block_ids):
            if self.prefix_cache.is_registered(b):
                self.prefix_cache.park(b)
            else:
                self._content_hash.pop(b, None)
                self.allocator.release([b])

    def _forget_contents(self, block_id: int) -> None:
        # The block is about to be (partly) overwritten. A shared block keeps its hash: the
        # writer must copy_on_write first, and the other holders still see its contents.
        if self.allocator.refcount(block_id) == 1:
            self._content_hash.pop(block_id, None)
            self.prefix_cache.unregister(block_id)

    def _check_prefix_hit(self, cached_blocks: Sequence[int], salt: str | None) -> None:
        # A hit must still be the registered chain match_prefix found (not evicted since).
        if not cached_blocks:
            return
        parent = root_hash(salt)
        for b in cached_blocks:
            entry = self.prefix_cache.entry(b)
            if entry is None or entry.parent_hash != parent:
                raise ValueError(f"stale prefix hit: block {b} is no longer cached; re-match")
            parent = entry.block_hash
