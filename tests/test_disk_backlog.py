"""A disk tier whose device falls behind its callers: ``put`` copies wait in memory for the
writer only up to ``disk_put_backlog_bytes``; beyond it a put drops its block, counted, so a
burst of evictions cannot grow the daemon's memory by a block's copy each."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import xxhash

from kvtier.tiers.disk import commit
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.disk.writer import DiskWriter
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.tunables import TUNABLES

from diskutil import key

BLOCK = 4096
SIG = xxhash.xxh3_128_digest(b"layout-a")
BACKLOG = 4


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def held_writer(monkeypatch) -> threading.Event:
    """Keeps the writer from committing (so no put's copy is retired) until the event is set,
    and bounds the backlog at ``BACKLOG`` blocks."""
    monkeypatch.setattr(
        commit, "TUNABLES", replace(TUNABLES, disk_put_backlog_bytes=BACKLOG * BLOCK)
    )
    release = threading.Event()
    process = DiskWriter._process

    def held(self, batch, sealed):
        release.wait()
        process(self, batch, sealed)

    monkeypatch.setattr(DiskWriter, "_process", held)
    return release


def test_puts_beyond_the_backlog_drop_their_blocks_and_count_them(tmp_path, monkeypatch):
    release = held_writer(monkeypatch)
    with DiskTier(tmp_path, SIG, BLOCK, 64 * BLOCK, sync=False) as disk:
        taken = [disk.put(key(i), block(i)) for i in range(BACKLOG + 3)]
        assert taken == [True] * BACKLOG + [False] * 3
        assert disk.put(key(0), block(0))  # already waiting: nothing new to copy
        assert disk.put(key(BACKLOG + 5), block(BACKLOG + 5), shed=False)  # shutdown's spill
        assert disk.counters.blocks_dropped == 3
        release.set()
        disk.flush()
        out = np.empty(BLOCK, np.uint8)
        for i in [*range(BACKLOG), BACKLOG + 5]:
            assert disk.get_into(key(i), out) and np.array_equal(out, block(i))
        assert not any(disk.contains(key(i)) for i in range(BACKLOG, BACKLOG + 3))
        # the copies were retired with their commit: the backlog has room again
        assert disk.put(key(100), block(100))


def test_evictions_the_disk_cannot_take_are_not_counted_as_spilled(tmp_path, monkeypatch):
    release = held_writer(monkeypatch)
    with DiskTier(tmp_path, SIG, BLOCK, 64 * BLOCK, sync=False) as disk:
        host = HostTier(BLOCK, 2 * BLOCK, lower=disk)
        for i in range(BACKLOG + 5):  # each store past the second evicts the oldest
            slots = host.reserve([key(i)])
            host.slot_array(slots[0])[:] = block(i)
            host.commit(slots)
        evicted = BACKLOG + 3
        assert host.counters.blocks_evicted == evicted
        assert host.counters.blocks_spilled == BACKLOG
        assert disk.counters.blocks_dropped == evicted - BACKLOG
        release.set()
        disk.flush()
        assert [disk.contains(key(i)) for i in range(evicted)] == [True] * BACKLOG + [False] * 3
