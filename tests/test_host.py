from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.lower import ALREADY_STORED, NO_SPACE

BLOCK = 64


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(host: HostTier, i: int) -> int:
    (slot,) = host.reserve([h(i)])
    assert slot >= 0
    host.slot_array(slot)[:] = i % 251
    host.commit([slot])
    return slot


def test_uncommitted_slot_is_never_readable():
    host = HostTier(BLOCK, BLOCK * 4)
    (slot,) = host.reserve([h(1)])
    assert host.lookup([h(1)]).total == 0
    assert host.acquire([h(1)]) == []
    assert host.reserve([h(1)]) == [ALREADY_STORED]
    host.abort([slot])
    assert host.lookup([h(1)]).total == 0
    assert host.counters.used_blocks == 0


def test_two_phase_store_and_load():
    host = HostTier(BLOCK, BLOCK * 4)
    store(host, 7)
    assert host.lookup([h(7), h(8)]).host == 1
    (slot,) = host.acquire([h(7)])
    assert np.all(host.slot_array(slot) == 7)
    host.release([slot])
    with pytest.raises(ValueError):
        host.release([slot])
    with pytest.raises(ValueError):
        host.commit([slot])


def test_acquired_slots_are_never_evicted_and_full_gives_no_space():
    host = HostTier(BLOCK, BLOCK * 2)
    store(host, 1)
    store(host, 2)
    pinned = host.acquire([h(1), h(2)])
    assert host.reserve([h(3)]) == [NO_SPACE]
    host.release(pinned[:1])
    (slot,) = host.reserve([h(3)])
    assert slot == pinned[0]  # slot of h(1), the only unpinned one, was recycled
    assert host.lookup([h(2)]).host == 1
    assert host.lookup([h(1)]).total == 0


def test_lru_order_follows_reads():
    host = HostTier(BLOCK, BLOCK * 2)
    store(host, 1)
    store(host, 2)
    host.release(host.acquire([h(1)]))  # h(1) is now the most recent
    store(host, 3)
    assert host.lookup([h(1)]).host == 1
    assert host.lookup([h(2)]).total == 0


def test_eviction_spills_to_disk_and_acquire_promotes(tmp_path):
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100)
    try:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk)
        for i in range(5):
            store(host, i)
        assert host.counters.blocks_spilled == 3
        hits = host.lookup([h(i) for i in range(6)])
        assert (hits.host, hits.disk) == (2, 3)
        slots = host.acquire([h(0), h(1)])
        assert [int(host.slot_array(s)[0]) for s in slots] == [0, 1]
        assert host.counters.blocks_promoted == 2
        host.release(slots)
        # a block already below is deduplicated instead of stored twice
        assert host.reserve([h(4)]) == [ALREADY_STORED]
    finally:
        disk.close()


def test_an_acquire_in_memory_takes_host_hits_alone_and_leaves_a_disk_hit_untouched(tmp_path):
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100)
    try:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk)
        for i in range(3):
            store(host, i)  # h(0) spills to the disk
        slots, sources = host.acquire_in_memory([h(1), h(2)])
        assert (sources.host, sources.disk) == (2, 0)
        assert [int(host.slot_array(s)[0]) for s in slots] == [1, 2]
        host.release(slots)  # head last: h(2) is the least recently used
        # h(0) needs a promotion (a disk read): nothing is pinned, touched or promoted
        assert host.acquire_in_memory([h(2), h(0)]) is None
        assert host.counters.blocks_promoted == 0
        store(host, 3)  # h(2) is still the least recently used and goes
        assert host.lookup([h(2)]).disk == 1
    finally:
        disk.close()


def test_an_acquire_in_memory_with_no_tier_below_is_the_plain_acquire():
    host = HostTier(BLOCK, BLOCK * 4)
    store(host, 1)
    slots, sources = host.acquire_in_memory([h(1), h(2), h(1)])
    assert (len(slots), sources.host) == (1, 1)
    host.release(slots)


def test_concurrent_promotion_of_one_hash(tmp_path):
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100)
    try:
        host = HostTier(BLOCK, BLOCK * 8, lower=disk)
        disk.put(h(9), np.full(BLOCK, 9, dtype=np.uint8))
        results: list[list[int]] = []

        def reader() -> None:
            results.append(host.acquire([h(9)]))

        threads = [threading.Thread(target=reader) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(len(r) == 1 for r in results)
        assert len({r[0] for r in results}) == 1  # promoted once, shared by all readers
        assert host.counters.blocks_promoted == 1
        for r in results:
            host.release(r)
    finally:
        disk.close()


def test_bad_input():
    with pytest.raises(ValueError):
        HostTier(BLOCK, BLOCK - 1)
    host = HostTier(BLOCK, BLOCK * 2)
    with pytest.raises(ValueError):
        host.reserve([b"short"])
    with pytest.raises(ValueError):
        host.abort([99])


def test_a_promotion_that_finds_every_slot_pinned_asks_to_reclaim_one(tmp_path):
    """The daemon's ``reclaim`` ends a lookup hold (here: a read) so that the promotion gets
    its slot at once; the tier calls it without its lock, since it releases through the tier."""
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100)
    try:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk)
        disk.put(h(9), np.full(BLOCK, 9, dtype=np.uint8))
        store(host, 1)
        store(host, 2)
        held = host.acquire([h(1), h(2)])
        asked: list[int] = []

        def reclaim() -> bool:
            asked.append(len(held))
            if not held:
                return False
            host.release([held.pop()])
            return True

        host.reclaim = reclaim
        slots = host.acquire([h(9)])
        assert asked == [2] and len(slots) == 1 and int(host.slot_array(slots[0])[0]) == 9
        host.release(slots + held)
    finally:
        disk.close()


def test_a_promotion_waits_for_a_slot_to_come_free(tmp_path):
    """Every slot pinned by reads when a disk hit is acquired: the promotion takes the first
    slot a release gives back instead of failing the engine's load at once."""
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100)
    try:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk)
        disk.put(h(9), np.full(BLOCK, 9, dtype=np.uint8))
        store(host, 1)
        store(host, 2)
        pinned = host.acquire([h(1), h(2)])
        ops = host._promoter._ops
        take_slot = ops.take
        releaser: list[threading.Thread] = []

        def full_once():
            slot = take_slot()
            if slot is None and not releaser:
                # the release needs the tier's lock, which the promotion gives up only to wait
                releaser.append(threading.Thread(target=host.release, args=(pinned[:1],)))
                releaser[0].start()
            return slot

        host._promoter._ops = dataclasses.replace(ops, take=full_once)
        slots = host.acquire([h(9)])
        releaser[0].join()
        assert len(slots) == 1 and int(host.slot_array(slots[0])[0]) == 9
        host.release(slots + pinned[1:])
    finally:
        disk.close()


def test_write_behind_enters_the_lru_tail_first_and_an_acquire_keeps_its_prefix(tmp_path):
    """The daemon's store path: committed slots join the LRU only as their disk writes finish,
    in the writer's order, over several disk batches. A chain committed head first must still
    be evicted tail first, and acquiring it back must not evict the head it is about to read."""
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 16)  # disk batches of 2 blocks
    try:
        host = HostTier(BLOCK, BLOCK * 8, lower=disk, write_behind=True)
        chain = [h(i) for i in range(6)]
        slots = host.reserve(chain)
        for i, slot in enumerate(slots):
            host.slot_array(slot)[:] = i
        host.commit(slots)
        disk.flush()
        for i in range(100, 105):  # two fill the free slots, three evict
            store(host, i)
            disk.flush()
        assert [host.contains(b) for b in chain] == [True] * 3 + [False] * 3  # tail went below
        acquired, sources = host.acquire_with_sources(chain)
        assert (sources.host, sources.disk) == (3, 3)
        assert [int(host.slot_array(s)[0]) for s in acquired] == list(range(6))
        host.release(acquired)
    finally:
        disk.close()


def test_a_reserve_reads_the_disk_index_once_per_batch(tmp_path, monkeypatch):
    """Whether the disk tier holds a hash, and whether it holds each block evicted to make
    room, is asked in one LMDB read transaction for the whole batch, not one per hash under
    the host tier's lock."""
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 256)
    try:
        host = HostTier(BLOCK, BLOCK * 32, lower=disk, write_behind=True)
        for i in range(32):  # a full host tier, every block on disk too
            store(host, i)
        disk.flush()
        on_disk = [h(i) for i in range(32)]
        assert all(disk.contains(b) for b in on_disk)
        index = disk._s.index
        read = index.read
        opened = []

        def counted_read():
            opened.append(1)
            return read()

        monkeypatch.setattr(index, "read", counted_read)
        batch = [h(i) for i in range(28, 92)]  # four already stored, sixty new
        slots = host.reserve(batch)
        assert slots[:4] == [ALREADY_STORED] * 4
        assert sum(s >= 0 for s in slots) == 32 and slots.count(NO_SPACE) == 28
        assert len(opened) <= 2, f"{len(opened)} read transactions for one reserve"
        monkeypatch.setattr(index, "read", read)
        host.abort([s for s in slots if s >= 0])
        assert all(disk.contains(b) for b in on_disk)  # every evicted block is still below
    finally:
        disk.close()
