"""The disk tier's data file: O_DIRECT where the filesystem allows it, the buffered fallback,
reads into buffers of any alignment, slots reused under readers."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.disk import slots as disk_slots
from kvtier.tiers.disk.commit import STAGED_BATCHES
from kvtier.tiers.disk.recovery import plan
from kvtier.tiers.disk.tier import DATA_FILE, DiskTier

from diskutil import BLOCK, SIG, block, key, read, tier, used_slots


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
    # the budget and the spares: two batches (a batch is an eighth of the budget here)
    assert (tmp_path / DATA_FILE).stat().st_size == (64 + 8 + 8) * stride
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
        total = capacity + STAGED_BATCHES * plan(BLOCK, capacity * BLOCK, None)[1]  # + spares
        assert sorted(t._s.table._free) == sorted(set(range(total)) - used_slots(t))


@pytest.mark.parametrize("size", [disk_slots.HUGE_PAGE, disk_slots.HUGE_PAGE + 3 * mmap.PAGESIZE])
@pytest.mark.parametrize("huge", [True, False])
def test_a_new_put_buffer_starts_on_a_huge_page_boundary_where_huge_pages_are_used(size, huge):
    """A huge page must start on a 2 MiB boundary; a buffer that did not would get none."""
    if huge and not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no transparent huge pages on this platform")
    buf = disk_slots._new_buffer(size, huge)
    address = np.frombuffer(buf, np.uint8).ctypes.data
    assert len(buf) == size and not buf.readonly
    assert address % (disk_slots.HUGE_PAGE if huge else mmap.PAGESIZE) == 0
    buf[-1] = 7  # every byte is the buffer's own
    assert buf[-1] == 7


def test_a_put_buffer_given_back_is_the_next_one_handed_out():
    pool = disk_slots.BufferPool(1 << 16, keep=2)
    first = pool.acquire()
    pool.release(first)
    assert pool.acquire() is first
