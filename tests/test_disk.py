"""The LMDB disk tier: round trips, recovery, corruption, layouts, the LRU budget, a full map."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.disk.commit import STAGED_BATCHES
from kvtier.tiers.disk.tier import DATA_FILE, DiskTier

from diskutil import BLOCK, SIG, block, key, read, tier

OTHER_SIG = xxhash.xxh3_128_digest(b"layout-b")


def test_roundtrip_is_bit_exact_for_every_buffer_kind(tmp_path):
    sources = [
        bytes(block(0)),
        memoryview(bytearray(block(1))),
        block(2),
        torch.from_numpy(block(3)).numpy(),
        block(4).reshape(8, -1),
    ]
    with tier(tmp_path) as t:
        for i, data in enumerate(sources):
            t.put(key(i), data)
        t.flush()
        for i in range(len(sources)):
            out = torch.empty(BLOCK, dtype=torch.uint8)
            assert t.get_into(key(i), out.numpy())
            assert np.array_equal(out.numpy(), block(i))
        buf = bytearray(BLOCK)
        assert t.get_into(key(0), buf) and buf == bytes(block(0))
        assert not t.get_into(key(99), buf)
        assert t.counters.blocks_stored == 5 and t.counters.blocks_loaded == 6
        assert t.counters.bytes_in == 5 * BLOCK and t.counters.used_bytes == 5 * BLOCK


def test_pending_block_is_visible_before_commit(tmp_path):
    gate = threading.Event()

    def hold_writer(kind: str, block_hash: bytes, meta: bytes) -> None:
        gate.wait(10)

    with tier(tmp_path, on_event=hold_writer) as t:
        t.put(key(0), block(0))
        with pytest.raises(TimeoutError):
            t.flush(timeout=0.2)  # the writer now waits inside on_event
        data = block(1)
        t.put(key(1), data)
        data[:] = 0  # put copied the bytes: reusing the caller's buffer changes nothing
        assert t.contains(key(1)) and t.lookup_prefix([key(0), key(1), key(2)]) == 2
        assert np.array_equal(read(t, 1), block(1))
        assert len(t) == 2 and t.counters.used_blocks <= 1
        gate.set()
        t.flush()
        assert t.counters.used_blocks == 2 and np.array_equal(read(t, 1), block(1))


def test_put_of_a_held_block_is_a_noop(tmp_path):
    events = []
    with tier(tmp_path, on_event=lambda kind, h, meta: events.append((kind, h))) as t:
        t.put(key(0), block(0))
        t.put(key(0), block(1))
        t.flush()
        t.put(key(0), block(2))
        t.flush()
        assert np.array_equal(read(t, 0), block(0))
        assert len(t) == 1 and t.counters.blocks_stored == 1
    assert events == [("stored", key(0))]


def test_reopen_recovers_blocks_counters_and_access_order(tmp_path):
    with tier(tmp_path, capacity_blocks=4) as t:
        for i in range(4):
            t.put(key(i), block(i))
            t.flush()
        assert read(t, 0) is not None  # 0 becomes the most recently used
    with tier(tmp_path, capacity_blocks=4) as t:
        assert len(t) == 4
        assert t.counters.used_blocks == 4 and t.counters.used_bytes == 4 * BLOCK
        t.put(key(4), block(4))  # evicts 1, the least recently used before the restart
        t.flush()
        assert not t.contains(key(1))
        for i in (0, 2, 3, 4):
            assert np.array_equal(read(t, i), block(i))


def test_reopen_with_smaller_budget_evicts_oldest(tmp_path):
    with tier(tmp_path, capacity_blocks=8) as t:
        for i in range(6):
            t.put(key(i), block(i))
            t.flush()
    with tier(tmp_path, capacity_blocks=3) as t:
        assert [t.contains(key(i)) for i in range(6)] == [False] * 3 + [True] * 3
        assert t.counters.used_blocks == 3 and t.counters.blocks_evicted == 3


def flip_everywhere(path: Path, needle: bytes, offset: int) -> None:
    """Flips one bit at ``offset`` from every copy of ``needle`` in the file, as bit rot would."""
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at >= 0, f"{needle.hex()} is not in {path.name}"
    while at >= 0:
        raw[at + offset] ^= 0x20
        at = raw.find(needle, at + 1)
    path.write_bytes(raw)


@pytest.mark.parametrize(
    "where",
    ["payload-first", "payload-mid", "payload-last", "entry-length", "entry-checksum"],
)
def test_corrupt_block_is_a_miss_counted_and_dropped(tmp_path, where):
    with tier(tmp_path) as t:
        t.put(key(0), block(0))
        t.put(key(1), block(1))
    if where.startswith("payload"):
        # the payload sits once in the data file; LMDB sees nothing wrong
        head = bytes(block(0)[:64])
        raw = (tmp_path / DATA_FILE).read_bytes()
        assert raw.count(head) == 1
        offset = {"payload-first": 0, "payload-mid": 500, "payload-last": BLOCK - 1}[where]
        flip_everywhere(tmp_path / DATA_FILE, head, offset)
    else:
        # the entry ends with the payload length and checksum, both big-endian
        checksum = xxhash.xxh3_64_digest(block(0))
        flip_everywhere(tmp_path / "data.mdb", checksum, -1 if where == "entry-length" else 3)

    events = []
    with tier(tmp_path, on_event=lambda kind, h, meta: events.append((kind, h))) as t:
        assert t.contains(key(0))
        assert read(t, 0) is None
        assert t.counters.checksum_failures == 1 and t.counters.blocks_loaded == 0
        t.flush()
        assert not t.contains(key(0)) and len(t) == 1
        assert events == [("removed", key(0))]
        assert np.array_equal(read(t, 1), block(1))
        t.put(key(0), block(0))  # a dropped block can be stored again
        t.flush()
        assert np.array_equal(read(t, 0), block(0))


def test_blocks_of_another_layout_are_misses(tmp_path):
    with tier(tmp_path) as t:
        for i in range(3):
            t.put(key(i), block(i))
    with DiskTier(tmp_path, OTHER_SIG, BLOCK, 64 * BLOCK, sync=False) as t:
        assert len(t) == 0 and t.lookup_prefix([key(0)]) == 0
        out = np.empty(BLOCK, np.uint8)
        assert not t.get_into(key(0), out)
        assert t.counters.used_bytes == 0 and t.counters.blocks_evicted == 3
        t.put(key(0), block(7))
        t.flush()
    with tier(tmp_path) as t:
        assert read(t, 0) is None and t.counters.blocks_evicted == 1
        assert len(t) == 0


def test_budget_evicts_least_recently_read(tmp_path):
    n = 4
    removed = []

    def on_event(kind: str, block_hash: bytes, meta: bytes) -> None:
        if kind == "removed":
            removed.append(block_hash)

    with tier(tmp_path, capacity_blocks=n, on_event=on_event) as t:
        for i in range(3 * n):
            if i >= n:
                assert np.array_equal(read(t, 0), block(0))  # keeps block 0 recent
            t.put(key(i), block(i))
            t.flush()
            assert t.counters.used_bytes <= t.counters.capacity_bytes
        survivors = [i for i in range(3 * n) if t.contains(key(i))]
        assert survivors == [0, 9, 10, 11]
        assert removed == [key(i) for i in range(1, 9)]
        assert t.counters.blocks_evicted == 8 and t.counters.used_blocks == n
        assert len(t) == n


_PIN = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=3, readonly=True)
txn = env.begin()
print("pinned", flush=True)
sys.stdin.read()
"""


def test_full_map_gives_up_blocks_instead_of_raising(tmp_path, caplog):
    with tier(tmp_path, capacity_blocks=1000, map_size=512 << 10) as t:
        capacity = t.counters.capacity_blocks
        assert 1 <= capacity < 1000  # the small map lowered the budget
        t.put(key(0), block(0))
        t.flush()
        # A reader in another process pins a snapshot, so no evicted page can be reused.
        pin = subprocess.Popen(
            [sys.executable, "-c", _PIN, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert pin.stdout.readline() == b"pinned\n"
            for i in range(1, 200):
                t.put(key(i), block(i))
                if i % 4 == 0:
                    t.flush()
            t.flush()
        finally:
            pin.communicate(b"", timeout=30)
        assert "map full" in caplog.text
        assert t.counters.blocks_stored < 200 and t.counters.used_blocks <= capacity
        for i in range(200):
            got = read(t, i)
            assert got is None or np.array_equal(got, block(i))
        for i in range(500, 500 + 2 * capacity):  # with the reader gone, pages are reused
            t.put(key(i), block(i))
            t.flush()
            assert np.array_equal(read(t, i), block(i))


def test_bad_sizes_raise_value_error(tmp_path):
    with tier(tmp_path) as t:
        with pytest.raises(ValueError):
            t.put(key(0), block(0, BLOCK - 1))
        with pytest.raises(ValueError):
            t.put(key(0)[:8], block(0))
        with pytest.raises(ValueError):
            t.get_into(key(0), np.empty(BLOCK + 1, np.uint8))
        with pytest.raises(ValueError):
            t.get_into(key(0), bytes(BLOCK))
        with pytest.raises(ValueError):
            t.lookup_prefix([key(0), b"short"])
        assert len(t) == 0
    with pytest.raises(ValueError):
        DiskTier(tmp_path, SIG[:8], BLOCK, 64 * BLOCK)
    with pytest.raises(ValueError):
        DiskTier(tmp_path, SIG, BLOCK, BLOCK - 1)


OPS = ["put", "put", "get", "get", "reopen"]


@settings(max_examples=50, deadline=None)
@given(
    capacity=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7)), max_size=30),
)
def test_matches_an_lru_model(capacity, ops):
    model: OrderedDict[int, None] = OrderedDict()
    with tempfile.TemporaryDirectory() as path:
        t = tier(Path(path), capacity_blocks=capacity)
        try:
            for op, i in ops:
                if op == "put" and i not in model:
                    model[i] = None
                    if len(model) > capacity:
                        model.popitem(last=False)
                if op == "put":
                    t.put(key(i), block(i))
                elif op == "get":
                    got = read(t, i)
                    assert (got is not None) == (i in model)
                    if i in model:
                        assert np.array_equal(got, block(i))
                        model.move_to_end(i)
                else:
                    t.close()
                    t = tier(Path(path), capacity_blocks=capacity)
                t.flush()
                assert [t.contains(key(j)) for j in range(8)] == [j in model for j in range(8)]
            assert len(t) == len(model)
        finally:
            t.close()


def test_budget_change_on_reopen_grows_or_shrinks_the_data_file(tmp_path):
    stride = -(-BLOCK // 4096) * 4096
    data_file = tmp_path / DATA_FILE

    def slots(capacity: int) -> int:
        """The budget and the spares: two batches (a batch is an eighth of the budget here)."""
        return capacity + STAGED_BATCHES * max(1, capacity // 8)

    with tier(tmp_path, capacity_blocks=8) as t:
        for i in range(8):
            t.put(key(i), block(i))
            t.flush()
        assert read(t, 0) is not None  # order, oldest first: 1..7, 0
    assert data_file.stat().st_size == slots(8) * stride
    with tier(tmp_path, capacity_blocks=16) as t:  # grows: everything stays
        assert data_file.stat().st_size == slots(16) * stride
        assert len(t) == 8 and t.counters.capacity_blocks == 16
        for i in range(8, 16):
            t.put(key(i), block(i))
        t.flush()
        assert t.counters.blocks_evicted == 0 and len(t) == 16
        for i in range(16):
            assert read(t, i) is not None  # order now 0..15
    with tier(tmp_path, capacity_blocks=3) as t:  # shrinks: the 3 newest move below the end
        assert data_file.stat().st_size == slots(3) * stride
        assert [i for i in range(16) if t.contains(key(i))] == [13, 14, 15]
        assert t.counters.blocks_evicted == 13 and t.counters.checksum_failures == 0
        for i in (13, 14, 15):
            assert np.array_equal(read(t, i), block(i))
        t.put(key(20), block(20))  # evicts 13, the oldest
        t.flush()
        assert [i for i in (13, 14, 15, 20) if t.contains(key(i))] == [14, 15, 20]
    with tier(tmp_path, capacity_blocks=3) as t:
        for i in (14, 15, 20):
            assert np.array_equal(read(t, i), block(i))
