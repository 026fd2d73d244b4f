import pytest
import torch

from verifypd.kvcache import KVPool


def _pool(dtype=torch.float32) -> KVPool:
    return KVPool(
        num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
        device="cpu",
    )  # fmt: skip


def test_shapes_and_layer_views():
    pool = _pool()
    assert pool.kv.shape == (3, 2, 5, 4, 2, 8)
    assert pool.kv.dtype == torch.float32
    assert torch.count_nonzero(pool.kv) == 0
    k, v = pool.layer(1)
    assert k.shape == v.shape == (5, 4, 2, 8)
    k[2, 1] = 7.0  # views: writes land in the pool
    v[3] = -1.0
    assert pool.kv[1, 0, 2, 1].eq(7.0).all()
    assert pool.kv[1, 1, 3].eq(-1.0).all()
    assert pool.kv[0].eq(0).all() and pool.kv[2].eq(0).all()


def test_copy_blocks_copies_k_and_v_of_all_layers():
    pool = _pool()
    torch.manual_seed(0)
    pool.kv.normal_()
    before = pool.kv.clone()
    pool.copy_blocks([(0, 3), (2, 4)])
    assert torch.equal(pool.kv[:, :, 3], before[:, :, 0])
    assert torch.equal(pool.kv[:, :, 4], before[:, :, 2])
    for b in (0, 1, 2):  # untouched
        assert torch.equal(pool.kv[:, :, b], before[:, :, b])
    pool.copy_blocks([])
    assert torch.equal(pool.kv[:, :, :3], before[:, :, :3])


@pytest.mark.parametrize("dtype, itemsize", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_block_budget_math(dtype, itemsize):
    per_block = KVPool.bytes_per_block(30, 16, 3, 64, dtype)
    assert per_block == 2 * 30 * 16 * 3 * 64 * itemsize
    assert KVPool.num_blocks_for_bytes(per_block * 10, 30, 16, 3, 64, dtype) == 10
    assert KVPool.num_blocks_for_bytes(per_block * 10 - 1, 30, 16, 3, 64, dtype) == 9
    assert KVPool.num_blocks_for_bytes(per_block - 1, 30, 16, 3, 64, dtype) == 0
    pool = _pool(dtype)
    assert pool.kv.numel() * pool.kv.element_size() == 5 * KVPool.bytes_per_block(3, 4, 2, 8, dtype)
