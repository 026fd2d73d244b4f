"""Joint KV sizing (``engine.kv_sizing``): the target's pool and the drafter's share one budget
and one block count; an explicit ``num_blocks`` applies to both; without a drafter the sizing
is what it always was."""

from __future__ import annotations

import torch
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import PRESETS, CacheConfig, SchedulerConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.kv_sizing import draft_graph_headroom, joint_num_blocks, kv_budget, size_kv

TINY = PRESETS["tiny"]
# dummy:tiny, fp32, block 16: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _pool_bytes(pool) -> int:
    return pool.kv.numel() * pool.kv.element_size()


def test_target_only_sizing_is_unchanged() -> None:
    budget = 1 << 20
    core = EngineCore(tiny_config(cache=CacheConfig(cpu_kv_bytes=budget)))
    assert core.pool.num_blocks == budget // TINY_BLOCK_BYTES == 128
    assert core.spec.drafter is None and core.kv_sizing.draft_bytes_per_block == 0
    # the default budget (1 GiB) is capped at every running sequence at full length
    capped = EngineCore(tiny_config())
    assert capped.pool.num_blocks == 256 * (2048 // 16 + 1)


def test_both_pools_share_the_cpu_budget_and_one_block_count() -> None:
    budget = 1 << 20
    core = EngineCore(tiny_config(cache=CacheConfig(cpu_kv_bytes=budget), spec=tiny_draft_spec()))
    drafter = core.spec.drafter
    assert drafter.pool.num_blocks == drafter.kv.num_blocks == core.pool.num_blocks
    assert core.pool.num_blocks == budget // (2 * TINY_BLOCK_BYTES) == 64
    assert _pool_bytes(core.pool) + _pool_bytes(drafter.pool) <= budget
    # the request limits bound a request by the pools' final block count
    assert core.limits.num_blocks == core.kv.num_blocks == 64
    assert core.limits.max_request_blocks == 32


def test_explicit_num_blocks_applies_to_both_pools() -> None:
    cfg = tiny_config(cache=CacheConfig(num_blocks=40, cpu_kv_bytes=1 << 16),
                      spec=tiny_draft_spec())  # fmt: skip
    core = EngineCore(cfg)
    assert core.pool.num_blocks == core.spec.drafter.pool.num_blocks == 40
    assert core.limits.num_blocks == 40 and core.kv_sizing.budget_bytes is None


def test_joint_sizing_of_a_7b_target_and_a_0_5b_drafter() -> None:
    target, draft = PRESETS["qwen2.5-7b"], PRESETS["qwen2.5-0.5b"]
    bf16 = torch.bfloat16
    t_bpb = 2 * 28 * 16 * 4 * 128 * 2  # 917,504 bytes
    d_bpb = 2 * 24 * 16 * 2 * 64 * 2  # 196,608 bytes
    budget = 50 * 2**30
    sizing = size_kv(target, draft, 16, bf16, budget, max_blocks=10**9)
    assert (sizing.target_bytes_per_block, sizing.draft_bytes_per_block) == (t_bpb, d_bpb)
    assert sizing.num_blocks == budget // (t_bpb + d_bpb)
    assert sizing.target_bytes + sizing.draft_bytes <= budget
    assert budget - (sizing.target_bytes + sizing.draft_bytes) < t_bpb + d_bpb
    assert "drafter" in sizing.describe() and "target" in sizing.describe()
    alone = size_kv(target, None, 16, bf16, budget, max_blocks=10**9)
    assert alone.num_blocks == budget // t_bpb and "drafter" not in alone.describe()


def test_joint_num_blocks_caps_and_floors() -> None:
    assert joint_num_blocks(1000, [100, 150], max_blocks=100) == 4
    assert joint_num_blocks(1000, [100, 150], max_blocks=3) == 3
    assert joint_num_blocks(10, [100, 150], max_blocks=100) == 1


def test_draft_graph_headroom_counts_the_logits_of_both_graphs() -> None:
    draft = PRESETS["qwen2.5-0.5b"]
    got = draft_graph_headroom(draft, 256, torch.bfloat16)
    assert got == 256 * (1 + 2) * 151936 * (2 + 4)
    # batches round up to the largest captured graph size at or below max_num_seqs
    assert draft_graph_headroom(draft, 100, torch.bfloat16) == 96 * 3 * 151936 * 6


def test_limits_and_scheduler_see_the_sized_pool() -> None:
    cfg = tiny_config(
        cache=CacheConfig(cpu_kv_bytes=1 << 19),
        scheduler=SchedulerConfig(max_request_kv_share=1.0),
        spec=tiny_draft_spec(),
    )
    core = EngineCore(cfg)
    assert core.pool.num_blocks == 32
    assert core.limits.max_request_blocks == 32 == core.scheduler.kv.num_blocks


def test_gpu_budget_leaves_the_utilization_headroom_and_the_drafter_graphs(monkeypatch) -> None:
    """An 80 GB H100 with a 7B target and a 0.5B drafter loaded (about 16 GB of weights): the
    two pools, the headroom that gpu_memory_utilization leaves and the drafter's graphs fit in
    what was free; before, the target's pool alone took all but the headroom."""
    total, free = 80 * 10**9, 63 * 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    target, draft = PRESETS["qwen2.5-7b"], PRESETS["qwen2.5-0.5b"]
    headroom = draft_graph_headroom(draft, 256, torch.bfloat16)
    budget = kv_budget(torch.device("cuda"), CacheConfig(), headroom)
    assert budget == free - 0.15 * total - headroom
    sizing = size_kv(target, draft, 16, torch.bfloat16, budget, max_blocks=10**9)
    used = sizing.target_bytes + sizing.draft_bytes + headroom
    assert (
        free - 0.15 * total - (sizing.target_bytes_per_block + sizing.draft_bytes_per_block) < used
    )
    assert used <= free - 0.15 * total
    assert kv_budget(torch.device("cpu"), CacheConfig(cpu_kv_bytes=12345)) == 12345
