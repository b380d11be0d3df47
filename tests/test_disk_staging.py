"""The disk tier's writer puts a batch's payloads on the device as the stores arrive, while the
batch still gathers: the device works while callers store, and only the commit waits; and
the next batch is written while a commit waits."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import numpy as np

from kvtier.tiers.disk import writer
from kvtier.tiers.disk.commit import STAGED_BATCHES, BatchCommitter
from kvtier.tiers.disk.recovery import plan
from kvtier.tiers.disk.slots import slot_stride
from kvtier.tiers.disk.tier import DATA_FILE, DiskTier
from kvtier.tiers.tunables import TUNABLES

from diskutil import BLOCK, SIG, block, key


def slot_contents(path, slots: int) -> set[bytes]:
    """The first ``slots`` slots of the data file as the device has them now."""
    stride = slot_stride(BLOCK)
    with open(os.path.join(path, DATA_FILE), "rb") as f:
        data = f.read(slots * stride)
    return {data[s * stride : s * stride + BLOCK] for s in range(len(data) // stride)}


def wait_until(condition, what: str, bound_s: float = 60.0) -> None:
    """Waits for a state; the bound only turns a state that never comes into a failure."""
    end = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < end, f"never saw: {what}"
        time.sleep(0.01)


def test_a_lingering_batch_writes_its_payloads_before_it_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "TUNABLES", replace(TUNABLES, disk_stage_bytes=2 * BLOCK))
    with DiskTier(tmp_path, SIG, BLOCK, 64 * BLOCK, sync=False, flush_interval_s=3600) as t:
        for i in range(3):
            t.put(key(i), block(i))
        wanted = {block(i).tobytes() for i in range(2)}  # one run; the third waits for more
        wait_until(lambda: wanted <= slot_contents(tmp_path, 2), "the payloads in their slots")
        assert t.counters.blocks_stored == 0  # the batch still lingers: nothing committed
        with t._s.index.read() as txn:
            assert not any(t._s.index.has(txn, key(i)) for i in range(3))
        t.flush()
        assert t.counters.blocks_stored == 3
        out = np.empty(BLOCK, np.uint8)
        for i in range(3):
            assert t.get_into(key(i), out) and np.array_equal(out, block(i))


def test_slots_staged_ahead_of_the_commit_come_from_the_spares(tmp_path):
    """Payloads take their slots before their batch commits and evicts: a small tier with
    two spare slots stores batch after batch, evicting, and never runs out of slots or hands
    one block's slot to another."""
    capacity = 16
    with DiskTier(tmp_path, SIG, BLOCK, capacity * BLOCK, sync=False) as t:
        for i in range(5 * capacity):
            t.put(key(i), block(i))
            if i % 3 == 2:
                t.flush()
        t.flush()
        assert t.counters.used_blocks == capacity
        out = np.empty(BLOCK, np.uint8)
        newest = range(4 * capacity, 5 * capacity)
        assert all(t.get_into(key(i), out) and np.array_equal(out, block(i)) for i in newest)


def test_the_next_batch_is_written_while_a_commit_waits(tmp_path, monkeypatch):
    """A batch commits on a thread of its own: while its commit waits (for the device, in its
    syncs), the writer gathers and writes the next batch, so the device does not idle."""
    committing, release = threading.Event(), threading.Event()
    commit = BatchCommitter.commit

    def held_commit(self, ops, batch):
        committing.set()
        release.wait(120)
        return commit(self, ops, batch)

    monkeypatch.setattr(BatchCommitter, "commit", held_commit)
    capacity = 64  # batches of 8 stores
    batch = plan(BLOCK, capacity * BLOCK, None)[1]
    with DiskTier(tmp_path, SIG, BLOCK, capacity * BLOCK, sync=False) as t:
        for i in range(2 * batch):
            t.put(key(i), block(i))
        try:
            assert committing.wait(60)
            wanted = {block(i).tobytes() for i in range(2 * batch)}
            slots = STAGED_BATCHES * batch
            wait_until(lambda: wanted <= slot_contents(tmp_path, slots), "both batches written")
            assert t.counters.blocks_stored == 0  # the first commit still waits
        finally:
            release.set()
        t.flush()
        assert t.counters.blocks_stored == 2 * batch
        out = np.empty(BLOCK, np.uint8)
        for i in range(2 * batch):
            assert t.get_into(key(i), out) and np.array_equal(out, block(i))
