"""Slots reserved before their hashes are known (``reserve_unnamed``), named as they are
committed (``commit_named``): never readable unnamed, deduplicated at the commit, given back
whole however the commit goes."""

from __future__ import annotations

import pytest

from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.lower import ALREADY_STORED

BLOCK = 64


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def write(host: HostTier, slot: int, i: int) -> None:
    host.slot_array(slot)[:] = i % 251


def test_unnamed_slots_are_named_by_their_commit_and_read_back():
    host = HostTier(BLOCK, BLOCK * 8)
    slots = host.reserve_unnamed(3)
    assert len(set(slots)) == 3
    assert host.counters.used_blocks == 0  # slots, not blocks yet
    assert host.snapshot() == []  # nothing is readable, nor known by any hash
    for i, slot in enumerate(slots):
        write(host, slot, i)
    assert host.commit_named(slots, [h(0), h(1), h(2)], [b"m0", b"m1", b"m2"]) == 0
    assert host.counters.used_blocks == 3
    got = host.acquire([h(0), h(1), h(2)])
    assert got == slots
    assert [int(host.slot_array(s)[0]) for s in got] == [0, 1, 2]
    assert [host.meta_of(s) for s in got] == [b"m0", b"m1", b"m2"]
    host.release(got)
    assert host.reserve([h(1)]) == [ALREADY_STORED]


def test_a_block_stored_already_is_not_stored_again_and_its_slot_comes_free():
    host = HostTier(BLOCK, BLOCK * 8)
    (first,) = host.reserve([h(7)])
    write(host, first, 7)
    host.commit([first])
    slots = host.reserve_unnamed(3)
    for slot in slots:
        write(host, slot, 99)
    # h(7) is stored already; h(8) comes twice: its first slot is stored, the second freed
    assert host.commit_named(slots, [h(7), h(8), h(8)]) == 2
    assert host.counters.used_blocks == 2
    assert host.counters.blocks_deduplicated == 2
    got = host.acquire([h(7), h(8)])
    assert got == [first, slots[1]]
    assert int(host.slot_array(first)[0]) == 7  # the stored block is untouched
    host.release(got)


def test_a_block_the_disk_tier_holds_is_not_stored_again(tmp_path):
    disk = DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 16)
    try:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk)
        for i in range(3):
            (slot,) = host.reserve([h(i)])
            write(host, slot, i)
            host.commit([slot])  # h(0) spills to the disk
        assert disk.contains(h(0))
        (slot,) = host.reserve_unnamed(1)
        assert host.commit_named([slot], [h(0)]) == 1
        assert host.lookup([h(0)]).disk == 1
    finally:
        disk.close()


def test_unnamed_slots_evict_the_lru_and_stop_at_pinned_ones():
    host = HostTier(BLOCK, BLOCK * 4)
    for i in range(4):
        (slot,) = host.reserve([h(i)])
        host.commit([slot])
    pinned = host.acquire([h(2), h(3)])
    assert len(host.reserve_unnamed(4)) == 2  # h(0) and h(1) evicted; h(2), h(3) are read
    assert host.lookup([h(0)]).total == 0
    assert host.lookup([h(2), h(3)]).host == 2
    host.release(pinned)


def test_misuse_is_refused_and_an_abort_gives_unnamed_slots_back():
    host = HostTier(BLOCK, BLOCK * 4)
    slots = host.reserve_unnamed(2)
    with pytest.raises(ValueError, match="not in the state"):
        host.commit_named([3], [h(1)])  # never reserved
    with pytest.raises(ValueError, match="hashes for"):
        host.commit_named(slots, [h(1)])
    with pytest.raises(ValueError, match="hashes for"):
        host.commit_named([slots[0], slots[0]], [h(1), h(2)])
    with pytest.raises(ValueError, match="16 bytes"):
        host.commit_named(slots[:1], [b"short"])
    (named,) = host.reserve([h(5)])
    with pytest.raises(ValueError, match="reserved by its hash"):
        host.commit_named([named], [h(6)])
    with pytest.raises(ValueError, match="unnamed"):
        host.commit(slots[:1])  # a plain commit cannot make a slot with no hash readable
    host.abort([*slots, named])
    assert host.counters.used_blocks == 0
    assert len(host.reserve_unnamed(4)) == 4
