"""How many KV blocks the pools get: one budget for the target's pool and the drafter's.

The drafter's pool mirrors the target's block for block (its views follow target sequences, and
``admission.RequestLimits`` bounds a request by one block count), so both pools have the same
number of blocks and one block costs the sum of the two models' bytes per block:
``num_blocks = budget // (target bytes per block + drafter bytes per block)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifypd.config import CacheConfig, ModelConfig
from verifypd.engine.cuda_graphs import graph_batch_sizes
from verifypd.kvcache import KVPool

# The drafter's CUDA graphs (``setup.capture_graphs``): q = 1 and q = 2 tokens per row.
DRAFT_GRAPH_QUERY_LENS = (1, 2)


@dataclass(frozen=True)
class KVSizing:
    """The pools' block count and what it was sized from (for the start-up log line)."""

    num_blocks: int
    block_size: int
    target_bytes_per_block: int
    draft_bytes_per_block: int  # 0 without a drafter
    budget_bytes: int | None  # None: ``CacheConfig.num_blocks`` was given

    @property
    def target_bytes(self) -> int:
        return self.num_blocks * self.target_bytes_per_block

    @property
    def draft_bytes(self) -> int:
        return self.num_blocks * self.draft_bytes_per_block

    def describe(self) -> str:
        gib = 2**30
        text = (
            f"sizing the KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
            f"(target {self.target_bytes / gib:.2f} GiB"
        )
        if self.draft_bytes_per_block:
            text += f" + drafter {self.draft_bytes / gib:.2f} GiB"
        if self.budget_bytes is None:
            return text + "; num_blocks given)"
        return text + f"; budget {self.budget_bytes / gib:.2f} GiB)"


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return KVPool.bytes_per_block(
        model.num_layers, block_size, model.num_kv_heads, model.head_dim, dtype
    )


def joint_num_blocks(budget_bytes: float, per_block: list[int], max_blocks: int) -> int:
    """The most blocks that fit ``budget_bytes`` when each costs ``sum(per_block)`` bytes (one
    block in every pool), at most ``max_blocks`` and at least 1."""
    return max(1, min(int(budget_bytes // sum(per_block)), max_blocks))


def size_kv(
    target: ModelConfig,
    draft: ModelConfig | None,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: float | None,
    max_blocks: int,
    num_blocks: int | None = None,
) -> KVSizing:
    """Both pools' block count: ``num_blocks`` when given (it applies to both), else the most
    that ``budget_bytes`` holds for both together (capped at ``max_blocks``)."""
    target_bpb = bytes_per_block(target, block_size, dtype)
    draft_bpb = bytes_per_block(draft, block_size, dtype) if draft is not None else 0
    if num_blocks is not None:
        return KVSizing(num_blocks, block_size, target_bpb, draft_bpb, None)
    assert budget_bytes is not None, "size_kv needs a budget or num_blocks"
    n = joint_num_blocks(budget_bytes, [target_bpb, draft_bpb], max_blocks)
    return KVSizing(n, block_size, target_bpb, draft_bpb, int(budget_bytes))


def draft_graph_headroom(draft: ModelConfig, max_batch: int, dtype: torch.dtype) -> int:
    """GPU bytes the drafter's CUDA-graph capture takes after the pools are allocated.

    Each captured query length keeps its largest batch's outputs alive in its graph pool (the
    smaller batches reuse that memory): the logits in the model dtype and their fp32 copy,
    [B * q, V] each. Those dominate; the activations of B * q <= 512 tokens of a 0.5B model are
    a few MB. Qwen2.5-0.5B at 256 rows: 3 * 256 * 151,936 * (2 + 4) bytes = 0.65 GiB. The
    catch-up chunk graphs (``SpecConfig.catch_up_chunk``) compute no logits: their activations
    (at most 8 rows of 256 tokens by default, tens of MB, four times that with chunks of 1,024;
    twice that with ``follow_prefill``, whose stream has a set of its own, and once more with
    ``follow_decode_stream`` "beside" or "below") fit the pools' slack."""
    rows = graph_batch_sizes(max_batch)[-1] * sum(DRAFT_GRAPH_QUERY_LENS)
    return rows * draft.vocab_size * (dtype.itemsize + 4)


def kv_budget(device: torch.device, cache: CacheConfig, draft_headroom: int = 0) -> float:
    """Bytes for the KV pools, measured once every model's weights are loaded.

    On GPU, what ``gpu_memory_utilization`` leaves out, (1 - u) x total (12 GB of an 80 GB H100
    at 0.85), is the headroom for what is allocated after the pools: the target's CUDA graphs
    (7B, estimated: ~0.25 GB of decode logits up to 256 rows and ~0.8 GB of verify logits up to
    64 rows of 2..5 tokens), the eager warm-up, the activations of a max_num_batched_tokens
    step (~1.5 GB at 8192 tokens) and the allocator's slack. ``draft_headroom`` (the drafter's
    graphs, ``draft_graph_headroom``) comes on top, so the target keeps the headroom it has
    without a drafter. On CPU the budget is ``cpu_kv_bytes`` for both pools together."""
    if device.type != "cuda":
        return cache.cpu_kv_bytes
    free, total = torch.cuda.mem_get_info(device)
    return free - (1 - cache.gpu_memory_utilization) * total - draft_headroom
