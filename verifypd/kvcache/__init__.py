"""Paged KV cache: ref-counted block allocator, prefix cache with LRU eviction, KV pool."""

from verifypd.kvcache.allocator import BlockAllocator
from verifypd.kvcache.manager import KVCacheManager
from verifypd.kvcache.pool import KVPool

__all__ = ["BlockAllocator", "KVCacheManager", "KVPool"]
