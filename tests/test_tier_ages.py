"""The age of each tier's oldest block and the rate its reads deliver: kept by the tiers,
published in the daemon's Stats and /metrics."""

from __future__ import annotations

import urllib.request

import lmdb
import numpy as np
import pytest

from kvtier.tiers.disk import clock as disk_clock
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.host.slots import SlotTable

from daemonutil import BLOCK_BYTES, SIGNATURE, Daemon, block_hash, load, store, wait_until

DELAY_MS = 40


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_host_slots_age_from_the_lru_head() -> None:
    clock = Clock()
    table = SlotTable(4, clock=clock)
    assert table.oldest_age_s() == 0.0  # nothing committed
    for slot in range(3):
        table.lru_push(slot)
        clock.now += 1.0  # slot 0 used at 100, 1 at 101, 2 at 102
    clock.now = 110.0
    assert table.oldest_age_s() == 10.0
    table.touch(0)  # read: slot 1 is now the least recently used
    assert table.oldest_age_s() == 9.0
    table.pin(1)  # held by a reader: out of the LRU, slot 2 is the oldest unheld
    assert table.oldest_age_s() == 8.0
    clock.now = 120.0
    table.unpin(1)  # released: used just now
    assert table.oldest_age_s() == 18.0
    table.lru_remove(2)
    table.lru_remove(0)
    assert table.oldest_age_s() == 0.0  # slot 1 was used just now
    table.lru_remove(1)
    assert table.oldest_age_s() == 0.0  # an empty LRU has no age


DISK_BLOCK = 4096


def disk_tier(path, clock: Clock, capacity_blocks: int = 8) -> DiskTier:
    return DiskTier(
        path, SIGNATURE, DISK_BLOCK, capacity_blocks * DISK_BLOCK, sync=False, clock=clock
    )


def put(tier: DiskTier, i: int) -> None:
    """Stores block ``i`` and commits it (the time the commit reads dates it)."""
    tier.put(block_hash("disk", i), np.full(DISK_BLOCK, i % 251, np.uint8))
    tier.flush()


def read(tier: DiskTier, i: int) -> None:
    """Reads block ``i`` and commits its access bump."""
    assert tier.get_into(block_hash("disk", i), np.empty(DISK_BLOCK, np.uint8)), i
    tier.flush()


def clock_samples(path) -> int:
    """The entries of a closed tier's ``clock`` database, read straight from LMDB."""
    with lmdb.open(str(path), max_dbs=4, readonly=True, lock=False) as env, env.begin() as txn:
        return txn.stat(env.open_db(b"clock", txn=txn, create=False))["entries"]


def test_disk_age_grows_for_an_untouched_oldest_block_and_drops_when_it_is_read_or_evicted(
    tmp_path,
) -> None:
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock, capacity_blocks=3) as tier:
        assert tier.oldest_block_age_s() == 0.0  # nothing stored
        for i in range(3):
            put(tier, i)  # block 0 used at 1000, 1 at 1010, 2 at 1020
            clock.now += 10.0
        clock.now = 1030.0
        assert tier.oldest_block_age_s() == 30.0
        clock.now = 1050.0
        assert tier.oldest_block_age_s() == 50.0
        read(tier, 0)  # block 1 is now the least recently used
        assert tier.oldest_block_age_s() == 40.0
        clock.now = 1060.0
        put(tier, 3)  # evicts block 1: block 2 is the oldest
        assert not tier.contains(block_hash("disk", 1))
        assert tier.oldest_block_age_s() == 40.0


def test_disk_age_is_an_upper_bound_within_the_clocks_resolution(tmp_path) -> None:
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock, capacity_blocks=2) as tier:
        put(tier, 0)
        clock.now = 1000.6
        put(tier, 1)  # within a second of the last sample: dated by it
        clock.now = 1002.0
        put(tier, 2)  # evicts block 0: block 1, used at 1000.6, is the oldest
        clock.now = 1010.0
        age = tier.oldest_block_age_s()
        assert 1010.0 - 1000.6 <= age < 1010.0 - 1000.6 + disk_clock.RESOLUTION_S, age


def test_disk_age_survives_a_reopen(tmp_path) -> None:
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock) as tier:
        put(tier, 0)
        clock.now = 1005.0
        put(tier, 1)
    clock.now = 2000.0  # the daemon was down a while
    with disk_tier(tmp_path, clock) as tier:
        assert tier.oldest_block_age_s() == 1000.0
        read(tier, 0)
        assert tier.oldest_block_age_s() == 995.0  # block 1, used at 1005
        read(tier, 1)
        assert tier.oldest_block_age_s() == 0.0  # both read just now


def test_disk_blocks_stored_before_the_clock_have_no_age_until_they_are_gone(tmp_path) -> None:
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock) as tier:
        for i in range(2):
            put(tier, i)
    with lmdb.open(str(tmp_path), max_dbs=4) as env, env.begin(write=True) as txn:
        txn.drop(env.open_db(b"clock", txn=txn), delete=True)  # an index from before it
    clock.now = 2000.0
    with disk_tier(tmp_path, clock) as tier:
        assert tier.oldest_block_age_s() is None  # no time dates block 0: no guess
        put(tier, 2)
        assert tier.oldest_block_age_s() is None
        read(tier, 0)
        assert tier.oldest_block_age_s() is None  # block 1 is still undated
        clock.now = 2007.0
        read(tier, 1)
        assert tier.oldest_block_age_s() == 7.0  # block 2, stored at 2000


def test_disk_clock_stays_bounded_while_undated_blocks_stay(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disk_clock, "MAX_SAMPLES", 8)
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock) as tier:
        for i in range(3):
            put(tier, i)
    with lmdb.open(str(tmp_path), max_dbs=4) as env, env.begin(write=True) as txn:
        txn.drop(env.open_db(b"clock", txn=txn), delete=True)  # an index from before it
    with disk_tier(tmp_path, clock) as tier:
        for n in range(100):  # block 0 stays the oldest, and undated
            clock.now += 1.0
            read(tier, 1 + n % 2)
        assert tier.oldest_block_age_s() is None
    assert clock_samples(tmp_path) <= 8


def test_disk_clock_stays_bounded_under_constant_eviction(tmp_path) -> None:
    clock = Clock(1000.0)
    capacity = 4
    with disk_tier(tmp_path, clock, capacity_blocks=capacity) as tier:
        for i in range(300):
            put(tier, i)  # a sample per store: each one a second after the last
            clock.now += 1.0
        assert tier.oldest_block_age_s() == capacity
    # The samples left date the live blocks, and one more at most.
    assert clock_samples(tmp_path) <= capacity + 1


def test_disk_reopen_forgets_samples_of_numbers_issued_again(tmp_path) -> None:
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock) as tier:
        for i in range(5):
            put(tier, i)  # a sample each
            clock.now += 1.0
    other = bytes(reversed(SIGNATURE))
    with DiskTier(tmp_path, other, DISK_BLOCK, 8 * DISK_BLOCK, sync=False, clock=clock) as tier:
        assert tier.counters.blocks_evicted == 5  # another layout's: dropped, numbering restarts
        for i in range(3):
            put(tier, i)  # within one second: one sample
        assert tier.oldest_block_age_s() == 0.0
    assert clock_samples(tmp_path) == 1


def test_disk_clock_thins_under_reads_but_keeps_the_oldest_blocks_time(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(disk_clock, "MAX_SAMPLES", 8)
    clock = Clock(1000.0)
    with disk_tier(tmp_path, clock, capacity_blocks=4) as tier:
        for i in range(4):
            put(tier, i)
        for n in range(100):  # block 0 stays the oldest: nothing is evicted
            clock.now += 1.0
            read(tier, 1 + n % 3)
        assert tier.oldest_block_age_s() == 100.0
    assert clock_samples(tmp_path) <= 8


@pytest.fixture
def slow_disk_daemon():
    d = Daemon(host_bytes=8 * BLOCK_BYTES, extra=["--disk-read-delay-ms", str(DELAY_MS)])
    d.start()
    yield d
    d.cleanup()


def test_daemon_publishes_ages_and_disk_read_rate(slow_disk_daemon) -> None:
    daemon = slow_disk_daemon
    client = daemon.client()
    try:
        first = [block_hash("age", i) for i in range(4)]
        assert store(client, first) == first
        wait_until(lambda: daemon.stats().layouts[0].writing_behind == 0, "disk writes")
        # Fill the 8-slot host tier twice over: the first blocks are left on disk alone.
        for batch in range(4):
            more = [block_hash(f"fill{batch}", i) for i in range(4)]
            assert store(client, more) == more
            wait_until(lambda: daemon.stats().layouts[0].writing_behind == 0, "disk writes")
        assert load(client, first) == first  # promoted from the slowed disk
    finally:
        client.close()
    tiers = {t.tier: t for t in daemon.stats().tiers}
    assert tiers["host"].HasField("oldest_block_age_s")
    assert tiers["host"].oldest_block_age_s >= 0.0
    assert tiers["disk"].HasField("oldest_block_age_s")
    assert tiers["disk"].oldest_block_age_s >= 0.0
    assert tiers["disk"].blocks_loaded == 4
    # Each read waited DELAY_MS at least: the rate can be no more than a block per delay.
    assert 0 < tiers["disk"].read_bytes_per_s <= BLOCK_BYTES / (DELAY_MS / 1000)
    url = f"http://127.0.0.1:{daemon.stats_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    layout = SIGNATURE.hex()
    assert f'kvtier_oldest_block_age_seconds{{layout="{layout}",tier="host"}}' in text
    assert f'kvtier_oldest_block_age_seconds{{layout="{layout}",tier="disk"}}' in text
    assert f'kvtier_read_bytes_per_second{{layout="{layout}",tier="disk"}}' in text
