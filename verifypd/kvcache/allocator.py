"""Physical block allocator: a free list plus one reference count per block."""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids from a free list and counts references to each block.

    Every block is in exactly one state: *free* (on the free list, ref 0), *referenced*
    (ref > 0), or *parked* (ref 0 but off the free list, because the prefix cache keeps its
    contents). The allocator does not know about caching: ``decref`` only reports the blocks
    whose count reached 0; the caller either parks them or returns them with ``release``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # FIFO: allocate from the left, release to the right, so ids are handed out in order.
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (ref count 0, not parked in a cache)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks off the free list with ref count 1, or None (nothing changed)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        block_ids = [self._free.popleft() for _ in range(n)]
        for b in block_ids:
            self._is_free[b] = False
            self._ref_counts[b] = 1
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        """Add one reference to each block. A parked block (ref 0) may be revived this way;
        a block on the free list may not (allocate it instead)."""
        for b in block_ids:
            if self._is_free[b]:
                raise ValueError(f"incref of block {b}, which is on the free list")
        for b in block_ids:
            self._ref_counts[b] += 1

    def decref(self, block_ids: list[int]) -> list[int]:
        """Drop one reference of each block; returns the blocks whose count reached 0, in
        order. Those blocks are parked: the caller must ``release`` them or keep them."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"decref of block {b}, which has no references")
        reached_zero = []
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                reached_zero.append(b)
        return reached_zero

    def release(self, block_ids: list[int]) -> None:
        """Put parked blocks (ref 0, off the free list) back at the end of the free list."""
        for b in block_ids:
            if self._ref_counts[b] != 0 or self._is_free[b]:
                raise ValueError(f"release of block {b}: not parked (ref {self._ref_counts[b]})")
            self._is_free[b] = True
            self._free.append(b)

    def refcount(self, block_id: int) -> int:
        """Current number of references to ``block_id``."""
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        """True if the block is on the free list."""
        return self._is_free[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list, next-to-allocate first (for tests and integrity checks)."""
        return list(self._free)
