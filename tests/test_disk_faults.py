"""The disk tier under threads and failures: concurrent readers, a second opener, SIGKILL
before and in the middle of a batch, a failing writer, a lost data file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvtier.tiers.disk import slots as disk_slots
from kvtier.tiers.disk.commit import BatchCommitter
from kvtier.tiers.disk.directory import DirectoryInUse
from kvtier.tiers.disk.tier import DATA_FILE
from kvtier.tiers.disk.writer import DiskWriter

from diskutil import (
    BLOCK,
    SIG,
    assert_holds_exactly,
    block,
    key,
    read,
    run_until_killed,
    tier,
)


def test_concurrent_readers_see_misses_or_exact_bytes(tmp_path):
    count = 96
    errors: list[BaseException] = []
    hits = [0]
    done = threading.Event()
    hashes = [key(i) for i in range(count)]
    expected = [block(i) for i in range(count)]

    def writer() -> None:
        for i in np.random.default_rng(1).permutation(count):
            t.put(hashes[i], expected[i])
            if i % 16 == 0:
                t.flush()
        t.flush()

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = np.empty(BLOCK, np.uint8)
        try:
            while not done.is_set():
                i = int(rng.integers(count))
                if t.get_into(hashes[i], out):
                    assert np.array_equal(out, expected[i]), f"block {i} came back wrong"
                    hits[0] += 1
                n = t.lookup_prefix(hashes[i:])
                assert 0 <= n <= count - i
        except BaseException as exc:
            errors.append(exc)

    with tier(tmp_path, capacity_blocks=64) as t:
        readers = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for r in readers:
            r.start()
        writer()
        done.set()
        for r in readers:
            r.join()
        assert not errors, errors
        assert hits[0] > 0 and t.counters.checksum_failures == 0
        assert t.counters.used_blocks == 64


def test_second_open_in_one_process_is_refused(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), block(0))
    mine = rf"{tmp_path}.* in use by process {os.getpid()} \(this process\)"
    with pytest.raises(DirectoryInUse, match=mine):
        tier(tmp_path)
    with pytest.raises(DirectoryInUse, match=mine):
        tier(tmp_path / ".." / tmp_path.name)
    t.close()
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        t.put(key(1), block(1))
    with tier(tmp_path) as again:
        assert np.array_equal(read(again, 0), block(0))


_CHILD = """
import os, signal, sys
import numpy as np, xxhash
from kvtier.tiers.disk import slots as disk_slots
from kvtier.tiers.disk.tier import DATA_FILE, DiskTier
from kvtier.tiers.disk.commit import BatchCommitter
from kvtier.tiers.disk.directory import DirectoryInUse
from kvtier.tiers.disk.index import parse
from kvtier.tiers.disk.writer import DiskWriter
sig, size, count = bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = DiskTier(sys.argv[1], sig, size, 64 * size)
for i in range(count):
    data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    t.put(xxhash.xxh3_128_digest(i.to_bytes(8, "little")), data)
t.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_flushed_blocks_survive_sigkill(tmp_path):
    run_until_killed(_CHILD, tmp_path, count=20, timeout=60)
    assert_holds_exactly(tmp_path, 20)


def test_writer_outlives_failures(tmp_path, monkeypatch, caplog):
    def broken_subscriber(kind: str, block_hash: bytes, meta: bytes) -> None:
        raise RuntimeError("subscriber bug")

    with tier(tmp_path, on_event=broken_subscriber) as t:
        t.put(key(0), block(0))
        t.flush()  # the subscriber's error is logged, the block is committed
        assert t.counters.used_blocks == 1
        assert "on_event" in caplog.text

        def failing_apply(self, txn, ops, prepared, taken):
            raise OSError("disk on fire")

        monkeypatch.setattr(BatchCommitter, "_apply", failing_apply)
        outcomes = []
        t.write_behind(key(1), block(1), on_done=outcomes.append)
        t.flush()  # a flush reports its own trouble only: the block's failure is its own
        assert outcomes == [False] and t.counters.blocks_dropped == 1
        assert not t.contains(key(1))  # lost, and not claimed
        assert "disk on fire" in caplog.text
        monkeypatch.undo()
        t.put(key(1), block(1))
        t.flush()
        assert np.array_equal(read(t, 1), block(1))


def test_failed_data_write_stores_nothing_and_leaks_no_slot(tmp_path, monkeypatch):
    def failing_write(self, writes):
        raise OSError(5, "I/O error")

    with tier(tmp_path, capacity_blocks=4) as t:  # 4 slots and one spare: a leak would show
        t.put(key(0), block(0))
        t.flush()
        for attempt in range(3):
            monkeypatch.setattr(disk_slots.SlotFile, "write", failing_write)
            outcomes = []
            t.write_behind(key(1 + attempt), block(1 + attempt), on_done=outcomes.append)
            t.flush()
            monkeypatch.undo()
            assert outcomes == [False]
            assert not t.contains(key(1 + attempt)) and t.counters.used_blocks == 1
        assert t.counters.blocks_dropped == 3
        for i in range(10, 30):
            t.put(key(i), block(i))
            t.flush()
        assert [read(t, i) is not None for i in range(26, 30)] == [True] * 4
        assert t.counters.used_blocks == 4 and t.counters.checksum_failures == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_flush_raises_once_the_writer_is_gone(tmp_path, monkeypatch):
    def killed(self, batch, sealed):
        raise SystemExit  # ends the writer thread, as no Exception would

    with tier(tmp_path) as t:
        monkeypatch.setattr(DiskWriter, "_process", killed)
        outcomes = []
        t.write_behind(key(0), block(0), on_done=outcomes.append)
        with pytest.raises(RuntimeError, match="writer stopped"):
            t.flush(timeout=10)
        assert outcomes == [False]  # told, not left waiting
        with pytest.raises(RuntimeError):
            t.put(key(1), block(1))
        t.write_behind(key(1), block(1), on_done=outcomes.append)
        assert outcomes == [False, False]


_CRASH_CHILD = """
import os, sys
import numpy as np, xxhash
from kvtier.tiers.disk.tier import DiskTier
sig, size = bytes.fromhex(sys.argv[2]), int(sys.argv[3])
t = DiskTier(sys.argv[1], sig, size, 16 * size)
for i in range(1_000_000):
    data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    t.put(xxhash.xxh3_128_digest(i.to_bytes(8, "little")), data)
    if i % 5 == 4:
        t.flush()
        print(i, flush=True)
"""


def test_sigkill_mid_batch_leaves_only_exact_blocks(tmp_path):
    """Killed while it writes and evicts: every block found after reopening is bit-exact."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASH_CHILD, str(tmp_path), SIG.hex(), str(BLOCK)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(40):  # well past the budget, so slots are being reused
            flushed = int(child.stdout.readline())
    finally:
        child.kill()
        child.wait(30)
    assert flushed >= 16 * 2
    with tier(tmp_path, capacity_blocks=16) as t:
        found = [i for i in range(flushed + 50) if t.contains(key(i))]
        assert set(range(flushed - 15, flushed + 1)) <= set(found)  # the flushed survivors
        for i in found:
            assert np.array_equal(read(t, i), block(i)), f"block {i} came back wrong"
        assert t.counters.checksum_failures == 0


def test_lost_data_file_drops_its_entries(tmp_path):
    with tier(tmp_path) as t:
        t.put(key(0), block(0))
    (tmp_path / DATA_FILE).unlink()
    with tier(tmp_path) as t:
        assert len(t) == 0 and read(t, 0) is None
        assert t.counters.checksum_failures == 0
        t.put(key(0), block(0))
        t.flush()
        assert np.array_equal(read(t, 0), block(0))
