"""Prefix cache: chained hashes of full blocks -> block ids, plus an LRU of evictable blocks.

The hash of block i chains the hash of block i-1 with the token ids of block i, so equal
hashes mean equal prefixes up to hash collisions. Each entry also stores its parent hash and
its token ids, and a lookup compares both, so a collision gives a miss, never a wrong hit.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple

ROOT_HASH = 0  # the "parent hash" of block 0


def root_hash(salt: str | None) -> int:
    """The "parent hash" of a sequence's block 0: ``ROOT_HASH`` unsalted, else a 64-bit digest
    of the request's ``cache_salt`` (never ``ROOT_HASH``). Differently salted prompts chain
    from different roots, so they never share a block: a lookup compares the parent hash too."""
    if salt is None:
        return ROOT_HASH
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"verifypd-salt").digest()
    return int.from_bytes(digest, "little") | 1


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block. Deterministic across processes (ints and tuples of
    ints are not salted by PYTHONHASHSEED)."""
    return hash((parent_hash, token_ids))


class CacheEntry(NamedTuple):  # a tuple: built ~3x faster than a frozen dataclass, per block
    block_id: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


class PrefixCache:
    """Registry of cached blocks. Knows nothing about reference counts: the manager tells it
    when a registered block loses its last reference (``park``) or gains one (``unpark``).

    Invariants: ``_by_hash`` and ``_by_block`` hold the same entries (one hash <-> one block);
    ``_evictable`` holds only registered blocks, least recently used first.
    """

    def __init__(self) -> None:
        self._by_hash: dict[int, CacheEntry] = {}
        self._by_block: dict[int, CacheEntry] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
        """Chained hash of a block (looked up at call time so tests can patch ``block_hash``)."""
        return block_hash(parent_hash, token_ids)

    def lookup(self, h: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Block id cached under ``h`` with exactly this parent hash and these tokens."""
        entry = self._by_hash.get(h)
        if entry is None or entry.parent_hash != parent_hash or entry.token_ids != token_ids:
            return None
        return entry.block_id

    def insert(self, block_id: int, h: int, parent_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Register ``block_id`` under ``h``; False (nothing changed) if ``h`` is taken."""
        if h in self._by_hash:
            return False
        if block_id in self._by_block:
            raise ValueError(f"block {block_id} is already registered")
        entry = CacheEntry(block_id, h, parent_hash, token_ids)
        self._by_hash[h] = entry
        self._by_block[block_id] = entry
        return True

    def unregister(self, block_id: int) -> None:
        """Forget a block's hash (no-op if it is not registered). It must not be parked."""
        if block_id in self._evictable:
            raise ValueError(f"unregister of parked block {block_id}; evict it instead")
        entry = self._by_block.pop(block_id, None)
        if entry is not None:
            del self._by_hash[entry.block_hash]

    def entry(self, block_id: int) -> CacheEntry | None:
        """The registration of ``block_id``, or None."""
        return self._by_block.get(block_id)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._by_block

    def is_parked(self, block_id: int) -> bool:
        """True if the block is registered, unreferenced and evictable."""
        return block_id in self._evictable

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_registered(self) -> int:
        return len(self._by_block)

    def park(self, block_id: int) -> None:
        """A registered block lost its last reference: it becomes the most recently used
        evictable block."""
        if block_id not in self._by_block:
            raise ValueError(f"park of unregistered block {block_id}")
        self._evictable[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A parked block is referenced again (prefix hit): it is no longer evictable."""
        del self._evictable[block_id]

    def evict(self) -> int:
        """Unregister and return the least recently used evictable block."""
        block_id, _ = self._evictable.popitem(last=False)
        entry = self._by_block.pop(block_id)
        del self._by_hash[entry.block_hash]
        return block_id

    def evict_all(self) -> list[int]:
        """Evict every evictable block, least recently used first."""
        return [self.evict() for _ in range(len(self._evictable))]

    def evictable_block_ids(self) -> list[int]:
        """Evictable blocks, least recently used first."""
        return list(self._evictable)

    def check(self) -> None:
        """Raise AssertionError unless the hash map, block map and LRU agree."""
        _require(len(self._by_hash) == len(self._by_block), "hash map and block map sizes differ")
        for h, entry in self._by_hash.items():
            _require(entry.block_hash == h, f"entry under hash {h} says {entry.block_hash}")
            _require(
                self._by_block.get(entry.block_id) is entry,
                f"hash {h} -> block {entry.block_id}, but the block map disagrees",
            )
        for b in self._evictable:
            _require(b in self._by_block, f"LRU holds unregistered block {b}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"kv cache integrity: {message}")
