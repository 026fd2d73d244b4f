"""KV pool: the paged K/V tensors of every layer of one model, allocated once."""

from __future__ import annotations

import torch


class KVPool:
    """One tensor ``kv`` of shape [num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]; index 0 of dim 1 is K, 1 is V. Block ids index dim 2 in every layer, so a block
    id from the cache manager names the same slots in all layers."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed so that never-written slots hold finite values (masked lanes may still read).
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer ``i``, views of shape [num_blocks, block_size, Hkv, D]."""
        return self.kv[i, 0], self.kv[i, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of each src block to its dst block in all layers, in one indexed copy.
        dst ids must be distinct and disjoint from src ids (copy_on_write guarantees both)."""
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.long)  # [n, 2]: (src, dst)
        if self.kv.is_cuda:
            index = index.pin_memory().to(self.kv.device, non_blocking=True)
        src, dst = index[:, 0], index[:, 1]
        self.kv.index_copy_(2, dst, self.kv.index_select(2, src))

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of K and V for one block across all layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def num_blocks_for_bytes(
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in ``budget_bytes`` (0 if not even one)."""
        per_block = KVPool.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return max(0, budget_bytes // per_block)
