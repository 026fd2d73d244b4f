import pytest

from verifypd.kvcache import BlockAllocator


def test_allocate_hands_out_ids_in_order_with_ref_one():
    a = BlockAllocator(num_blocks=6, block_size=4)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    assert [a.refcount(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert a.num_free_blocks == 1


def test_allocate_too_many_returns_none_and_changes_nothing():
    a = BlockAllocator(num_blocks=4, block_size=4)
    a.allocate(2)
    assert a.allocate(3) is None
    assert a.num_free_blocks == 2
    assert a.free_block_ids() == [2, 3]
    assert a.allocate(0) == []


def test_decref_reports_zero_blocks_and_release_appends_to_free_list():
    a = BlockAllocator(num_blocks=4, block_size=4)
    blocks = a.allocate(3)
    a.incref([1])
    assert a.decref(blocks) == [0, 2]
    assert a.refcount(1) == 1
    # Reached-zero blocks are parked until released: not on the free list yet.
    assert a.free_block_ids() == [3]
    a.release([2, 0])
    assert a.free_block_ids() == [3, 2, 0]
    assert a.allocate(2) == [3, 2]


def test_parked_block_can_be_revived_by_incref():
    a = BlockAllocator(num_blocks=2, block_size=4)
    (b,) = a.allocate(1)
    assert a.decref([b]) == [b]
    a.incref([b])
    assert a.refcount(b) == 1
    assert not a.is_free(b)


def test_misuse_raises_without_changing_state():
    a = BlockAllocator(num_blocks=3, block_size=4)
    a.allocate(1)
    with pytest.raises(ValueError):
        a.incref([0, 1])  # 1 is on the free list
    assert a.refcount(0) == 1
    with pytest.raises(ValueError):
        a.decref([0, 2])  # 2 has no references
    assert a.refcount(0) == 1
    with pytest.raises(ValueError):
        a.release([0])  # still referenced
    with pytest.raises(ValueError):
        a.allocate(-1)
    with pytest.raises(ValueError):
        BlockAllocator(0, 4)
