"""The LMDB disk tier: round trips, recovery, corruption, LRU budget, full map, threads, crashes."""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.disk import slots as disk_slots
from kvtier.tiers.disk.commit import BatchCommitter
from kvtier.tiers.disk.directory import DirectoryInUse
from kvtier.tiers.disk.index import parse
from kvtier.tiers.disk.tier import DATA_FILE, DiskTier
from kvtier.tiers.disk.writer import DiskWriter

BLOCK = 16 * 1024 + 8  # not a multiple of the page size on purpose
SIG = xxhash.xxh3_128_digest(b"layout-a")
OTHER_SIG = xxhash.xxh3_128_digest(b"layout-b")


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def block(i: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def tier(path: Path, capacity_blocks: int = 64, **kwargs) -> DiskTier:
    kwargs.setdefault("sync", False)
    return DiskTier(path, SIG, BLOCK, capacity_blocks * BLOCK, **kwargs)


def read(t: DiskTier, i: int) -> np.ndarray | None:
    out = np.empty(BLOCK, np.uint8)
    return out if t.get_into(key(i), out) else None


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
    count = 20
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), SIG.hex(), str(BLOCK), str(count)],
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    with tier(tmp_path) as t:
        assert len(t) == count
        for i in range(count):
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
    def killed(self, batch):
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


def direct_io_works(path: Path) -> bool:
    try:
        os.close(os.open(path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    return True


def test_data_file_uses_o_direct_where_the_filesystem_allows(tmp_path):
    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    with tier(tmp_path) as t:
        assert t._s.slots.direct
        assert fcntl.fcntl(t._s.slots._fd, fcntl.F_GETFL) & os.O_DIRECT
        t.put(key(0), block(0))
        t.flush()
        assert np.array_equal(read(t, 0), block(0))
    stride = -(-BLOCK // 4096) * 4096
    assert (tmp_path / DATA_FILE).stat().st_size == (64 + 8) * stride  # budget + spare batch
    assert os.path.getsize(tmp_path / "data.mdb") < 1 << 20  # no payload in LMDB


def test_buffered_fallback_where_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_slots, "_O_DIRECT", 0)
    with tier(tmp_path) as t:
        assert not t._s.slots.direct
        for i in range(3):
            t.put(key(i), block(i))
    assert "no O_DIRECT" in caplog.text
    with tier(tmp_path) as t:
        for i in range(3):
            assert np.array_equal(read(t, i), block(i))


@pytest.mark.parametrize("size", [4 * 4096, 4 * 4096 + 8, 100])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_reads_into_aligned_and_unaligned_buffers(tmp_path, size, aligned):
    area = mmap.mmap(-1, 2 * size + 4096)  # page-aligned
    out = memoryview(area)[0 if aligned else 64 :][:size]
    with DiskTier(tmp_path, SIG, size, 8 * size, sync=False) as t:
        t.put(key(0), block(0, size))
        t.flush()
        assert t.get_into(key(0), out)
        assert bytes(out) == bytes(block(0, size))
    out.release()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_slot_reuse_under_concurrent_readers(tmp_path, monkeypatch, direct):
    """Blocks are evicted and their slots reused while readers read: a read returns the exact
    bytes or misses, and no good block is ever taken for a corrupt one."""
    if not direct:
        monkeypatch.setattr(disk_slots, "_O_DIRECT", 0)
    read_into = disk_slots.SlotFile.read_into

    def slow_read_into(self, slot, dst):
        time.sleep(0.0005)  # widens the window between the lookup and the read
        read_into(self, slot, dst)

    monkeypatch.setattr(disk_slots.SlotFile, "read_into", slow_read_into)
    count, capacity = 160, 3
    errors: list[BaseException] = []
    hits = [0]
    done = threading.Event()
    expected = [block(i) for i in range(count)]
    newest = [0]

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = np.empty(BLOCK, np.uint8)
        try:
            while not done.is_set():
                i = max(0, newest[0] - int(rng.integers(6)))  # recent: often just evicted
                if t.get_into(key(i), out):
                    assert np.array_equal(out, expected[i]), f"block {i} came back wrong"
                    hits[0] += 1
        except BaseException as exc:
            errors.append(exc)

    with tier(tmp_path, capacity_blocks=capacity) as t:
        readers = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for r in readers:
            r.start()
        for i in range(count):
            t.put(key(i), expected[i])
            t.flush()
            newest[0] = i
        done.set()
        for r in readers:
            r.join()
        assert not errors, errors
        assert hits[0] > 0 and t.counters.checksum_failures == 0
        assert t.counters.blocks_evicted == count - capacity
        assert sorted(t._s.table._free) == sorted(set(range(capacity + 1)) - used_slots(t))


def used_slots(t: DiskTier) -> set[int]:
    with t._s.index.read() as txn:
        return {parse(bytes(v)).slot for _, v in txn.cursor()}


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


def test_budget_change_on_reopen_grows_or_shrinks_the_data_file(tmp_path):
    stride = -(-BLOCK // 4096) * 4096
    data_file = tmp_path / DATA_FILE
    with tier(tmp_path, capacity_blocks=8) as t:
        for i in range(8):
            t.put(key(i), block(i))
            t.flush()
        assert read(t, 0) is not None  # order, oldest first: 1..7, 0
    assert data_file.stat().st_size == (8 + 1) * stride
    with tier(tmp_path, capacity_blocks=16) as t:  # grows: everything stays
        assert data_file.stat().st_size == (16 + 2) * stride
        assert len(t) == 8 and t.counters.capacity_blocks == 16
        for i in range(8, 16):
            t.put(key(i), block(i))
        t.flush()
        assert t.counters.blocks_evicted == 0 and len(t) == 16
        for i in range(16):
            assert read(t, i) is not None  # order now 0..15
    with tier(tmp_path, capacity_blocks=3) as t:  # shrinks: the 3 newest move below the end
        assert data_file.stat().st_size == (3 + 1) * stride
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
