from __future__ import annotations

import pytest

from kvtier.tiers.free_queue import FreeBlockQueue, KVBlock
from kvtier.tiers.pool import GpuBlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_middle_removal():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q.iter_from_head()) == [0, 1, 3, 4]
    assert ids(q.popleft_n(2)) == [0, 1]
    q.append(blocks[0])
    assert ids(q.iter_from_head()) == [3, 4, 0]
    assert q.popleft().block_id == 3
    assert q.num_free == 2
    with pytest.raises(ValueError):
        q.popleft_n(3)
    with pytest.raises(ValueError):
        q.remove(blocks[3])


def test_lazy_eviction_keeps_freed_blocks_findable_until_recycled():
    pool = GpuBlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"a" * 16, b"b" * 16])
    pool.free_blocks(reversed(a))
    assert pool.num_free == 4
    assert pool.get_cached_block(b"a" * 16) is a[0]
    # two unhashed blocks sit before the freed ones; taking them keeps the hashes alive
    pool.get_new_blocks(2)
    assert pool.get_cached_block(b"b" * 16) is a[1]
    # next recycle takes the request's tail first (freed in reverse), then its head
    (tail,) = pool.get_new_blocks(1)
    assert tail is a[1]
    assert pool.get_cached_block(b"b" * 16) is None
    assert pool.get_cached_block(b"a" * 16) is a[0]
    assert pool.counters.blocks_evicted == 1


def test_touch_rescues_a_cached_free_block():
    pool = GpuBlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"x" * 16])
    pool.free_blocks([a])
    pool.touch([pool.get_cached_block(b"x" * 16)])
    assert a.ref_cnt == 1
    assert a not in pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_ref_counts_never_go_negative():
    pool = GpuBlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_duplicate_hash_stays_with_first_block():
    pool = GpuBlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h" * 16])
    pool.cache_full_blocks([b], [b"h" * 16])
    assert pool.get_cached_block(b"h" * 16) is a
    assert b.block_hash is None
    with pytest.raises(ValueError):
        pool.cache_full_blocks([a], [b"z" * 16])
