"""The age of each tier's oldest block and the rate its reads deliver: kept by the tiers,
published in the daemon's Stats and /metrics."""

from __future__ import annotations

import urllib.request

import pytest

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
    assert not tiers["disk"].HasField("oldest_block_age_s")  # LMDB keeps an order, no times
    assert tiers["disk"].blocks_loaded == 4
    # Each read waited DELAY_MS at least: the rate can be no more than a block per delay.
    assert 0 < tiers["disk"].read_bytes_per_s <= BLOCK_BYTES / (DELAY_MS / 1000)
    url = f"http://127.0.0.1:{daemon.stats_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    layout = SIGNATURE.hex()
    assert f'kvtier_oldest_block_age_seconds{{layout="{layout}",tier="host"}}' in text
    assert f'kvtier_oldest_block_age_seconds{{layout="{layout}",tier="disk"}}' not in text
    assert f'kvtier_read_bytes_per_second{{layout="{layout}",tier="disk"}}' in text
