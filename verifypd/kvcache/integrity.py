"""Consistency check of a KV cache manager's state (used by tests and debug runs)."""

from __future__ import annotations

from collections import Counter

from verifypd.kvcache.allocator import BlockAllocator
from verifypd.kvcache.prefix_cache import PrefixCache


def _require(ok: bool, message: str) -> None:
    # Explicit raise, not ``assert``: the check must also work under ``python -O``.
    if not ok:
        raise AssertionError(f"kv cache integrity: {message}")


def check_integrity(
    allocator: BlockAllocator,
    cache: PrefixCache,
    content_hash: dict[int, int],
    live_tables: list[list[int]] | None = None,
) -> None:
    """Raise AssertionError unless: every block is in exactly one of free / in use (ref > 0) /
    cached (ref 0, evictable), so the three counts sum to ``num_blocks``; the hash maps agree;
    the LRU holds only ref-0 registered blocks; and, with ``live_tables``, each block's ref
    count equals its number of occurrences across the tables."""
    free = allocator.free_block_ids()
    _require(len(set(free)) == len(free), f"free list has duplicates: {sorted(free)}")
    cache.check()
    _check_block_states(allocator, set(free), set(cache.evictable_block_ids()))
    _check_content_hashes(allocator, cache, content_hash)
    if live_tables is not None:
        _check_live_tables(allocator, live_tables)


def _check_block_states(allocator: BlockAllocator, free: set[int], parked: set[int]) -> None:
    for b in range(allocator.num_blocks):
        ref = allocator.refcount(b)
        _require(ref >= 0, f"block {b} has ref count {ref}")
        states = [name for name, yes in (("free", b in free), ("cached", b in parked)) if yes]
        if ref > 0:
            states.append(f"in use (ref {ref})")
        _require(len(states) == 1, f"block {b} is in {states or 'no state'}, expected one")
        _require(allocator.is_free(b) == (b in free), f"block {b}: free flag disagrees")


def _check_content_hashes(
    allocator: BlockAllocator, cache: PrefixCache, content_hash: dict[int, int]
) -> None:
    for b in range(allocator.num_blocks):
        entry = cache.entry(b)
        if entry is not None:
            _require(not allocator.is_free(b), f"registered block {b} is on the free list")
            _require(
                content_hash.get(b) == entry.block_hash,
                f"registered block {b}: hash {entry.block_hash}, memo {content_hash.get(b)}",
            )
        if b in content_hash:
            _require(not allocator.is_free(b), f"free block {b} still has a content hash")


def _check_live_tables(allocator: BlockAllocator, live_tables: list[list[int]]) -> None:
    occurrences = Counter(b for table in live_tables for b in table)
    for b in occurrences:
        _require(0 <= b < allocator.num_blocks, f"live table holds invalid block id {b}")
    for b in range(allocator.num_blocks):
        ref = allocator.refcount(b)
        _require(
            ref == occurrences[b],
            f"block {b} has ref count {ref} but appears {occurrences[b]} times in live tables",
        )
