"""The disk tier's borrow-style stores: each caller hears its own blocks' outcome exactly once,
meta travels with the block, failures are counted and logged once per kind, and batches linger
at most ``flush_interval_s``."""

from __future__ import annotations

import logging
import mmap
import subprocess
import sys
import threading
import time

import lmdb
import numpy as np
import pytest

from kvtier.tiers.disk import slots as disk_slots
from kvtier.tiers.disk.index import _ENTRY, FORMAT_VERSION
from kvtier.tiers.disk.tier import MAX_META_BYTES, DiskTier

from diskutil import (
    SIG,
    assert_holds_exactly,
    block,
    key,
    read,
    run_until_killed,
    tier,
)

ALIGNED = 4 * 4096  # whole pages: written straight from the caller's buffer


class Outcomes:
    """``on_done`` callbacks that record every call, per block."""

    def __init__(self) -> None:
        self.calls: dict[int, list[bool]] = {}
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.all_told = threading.Condition(self.lock)

    def for_block(self, i: int):
        def on_done(ok: bool) -> None:
            with self.lock:
                self.calls.setdefault(i, []).append(ok)
                self.threads.add(threading.current_thread().name)
                self.all_told.notify_all()

        return on_done

    def wait(self, count: int) -> None:
        with self.lock:
            assert self.all_told.wait_for(lambda: len(self.calls) >= count, timeout=60)


def aligned_blocks(count: int, size: int = ALIGNED, offset: int = 0) -> tuple[mmap.mmap, list]:
    """``count`` blocks of ``size`` bytes in page-aligned memory (plus ``offset``)."""
    area = mmap.mmap(-1, count * size + 4096)
    rows = np.frombuffer(area, np.uint8)[offset : offset + count * size].reshape(count, size)
    for i in range(count):
        rows[i] = block(i, size)
    return area, list(rows)


@pytest.mark.parametrize("offset", [0, 64], ids=["aligned", "unaligned"])
def test_write_behind_writes_from_the_callers_buffer_or_a_bounce(tmp_path, monkeypatch, offset):
    written = []
    write = disk_slots.SlotFile.write

    def recording_write(self, writes):
        written.extend(np.frombuffer(buf, np.uint8).ctypes.data for _, buf in writes)
        write(self, writes)

    monkeypatch.setattr(disk_slots.SlotFile, "write", recording_write)
    area, rows = aligned_blocks(4, offset=offset)
    outcomes = Outcomes()
    with DiskTier(tmp_path, SIG, ALIGNED, 64 * ALIGNED, sync=False) as t:
        for i, row in enumerate(rows):
            t.write_behind(key(i), row, meta=b"m%d" % i, on_done=outcomes.for_block(i))
            assert t.contains(key(i))  # readable at once, before the commit
        t.flush()
        assert outcomes.calls == {i: [True] for i in range(4)}
        assert outcomes.threads == {"kvtier-disk-commit_0"}  # the tier's, not the caller's
        addresses = {row.ctypes.data for row in rows}
        if offset == 0 or not t._s.slots.direct:  # the page cache takes any address
            assert set(written) == addresses  # no copy anywhere
        else:
            assert not set(written) & addresses  # copied, on the writer thread
            assert all(a % 4096 == 0 for a in written)
        out = np.empty(ALIGNED, np.uint8)
        for i in range(4):
            assert t.get_into(key(i), out) and np.array_equal(out, block(i, ALIGNED))
    assert len(area) > ALIGNED  # the rows' memory outlived every use


def test_each_block_is_told_once_even_when_stored_twice(tmp_path):
    outcomes = Outcomes()
    with tier(tmp_path, flush_interval_s=3600) as t:
        t.write_behind(key(0), block(0), on_done=outcomes.for_block(0))
        t.write_behind(key(0), block(0), on_done=outcomes.for_block(1))  # joins the first
        t.put(key(0), block(0))
        assert outcomes.calls == {}  # the batch lingers: nothing committed yet
        t.flush()
        assert outcomes.calls == {0: [True], 1: [True]}
        t.write_behind(key(0), block(0), on_done=outcomes.for_block(2))
        assert outcomes.calls[2] == [True]  # already held: told at once, on this thread
        t.write_behind(key(1), block(1))  # no on_done at all is fine
        t.flush()
        assert t.counters.blocks_stored == 2 and t.contains(key(1))


def test_a_failed_batch_is_reported_to_its_own_blocks_only(tmp_path, monkeypatch, caplog):
    """a failure went to whoever flushed next. Caller A's blocks fall in
    a failed write; caller B's, stored after it, are fine, and B's flush does not raise."""
    fail = threading.Event()
    write = disk_slots.SlotFile.write

    def failing_once(self, writes):
        if fail.is_set():
            fail.clear()
            raise OSError(5, "Input/output error")
        write(self, writes)

    monkeypatch.setattr(disk_slots.SlotFile, "write", failing_once)
    a, b = Outcomes(), Outcomes()
    with tier(tmp_path, flush_interval_s=3600) as t:
        fail.set()
        for i in range(3):
            t.write_behind(key(i), block(i), on_done=a.for_block(i))
        t.flush()
        for i in range(3, 6):
            t.write_behind(key(i), block(i), on_done=b.for_block(i))
        t.flush()  # B's barrier: no trouble of its own
        assert a.calls == {i: [False] for i in range(3)}
        assert b.calls == {i: [True] for i in range(3, 6)}
        assert t.counters.blocks_dropped == 3
        assert [t.contains(key(i)) for i in range(6)] == [False] * 3 + [True] * 3
    assert caplog.text.count("Input/output error") == 1


def test_failures_are_logged_once_per_kind_not_per_block(tmp_path, monkeypatch, caplog):
    def failing(self, writes):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk_slots.SlotFile, "write", failing)
    outcomes = Outcomes()
    with tier(tmp_path) as t:
        t._s.failures.interval_s = 3600  # a run of this test never outlasts it
        for i in range(40):
            t.write_behind(key(i), block(i), on_done=outcomes.for_block(i))
            if i % 4 == 3:
                t.flush()
        assert outcomes.calls == {i: [False] for i in range(40)}
        assert t.counters.blocks_dropped == 40 and t.counters.blocks_stored == 0
    lines = [r for r in caplog.records if "not stored" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING


def test_full_map_tells_every_block_and_counts_the_drops(tmp_path, caplog):
    outcomes = Outcomes()
    with tier(tmp_path, capacity_blocks=1000, map_size=512 << 10) as t:
        t._s.failures.interval_s = 3600
        t.put(key(0), block(0))
        t.flush()
        pin = subprocess.Popen(
            [sys.executable, "-c", PIN, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert pin.stdout.readline() == b"pinned\n"
            for i in range(1, 200):
                t.write_behind(key(i), block(i), on_done=outcomes.for_block(i))
                if i % 4 == 0:
                    t.flush()
            t.flush()
        finally:
            pin.communicate(b"", timeout=30)
        assert sorted(outcomes.calls) == list(range(1, 200))
        assert all(len(calls) == 1 for calls in outcomes.calls.values())
        failed = [i for i, calls in outcomes.calls.items() if calls == [False]]
        assert failed and t.counters.blocks_dropped == len(failed)
        for i in failed:
            assert not t.contains(key(i))
    assert caplog.text.count("map full") == 1


PIN = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=3, readonly=True, lock=True)
txn = env.begin()
print("pinned", flush=True)
sys.stdin.read()
"""


def test_write_behind_on_a_closed_tier_fails_at_once(tmp_path):
    outcomes = Outcomes()
    t = tier(tmp_path)
    t.close()
    t.write_behind(key(0), block(0), on_done=outcomes.for_block(0))
    assert outcomes.calls == {0: [False]} and t.counters.blocks_dropped == 1


def test_bad_arguments_raise_and_call_nothing(tmp_path):
    outcomes = Outcomes()
    with tier(tmp_path) as t:
        for bad in (
            dict(block_hash=key(0)[:8], data=block(0)),
            dict(block_hash=key(0), data=block(0)[:-1]),
            dict(block_hash=key(0), data=block(0).reshape(2, -1)[:, ::2]),  # not contiguous
            dict(block_hash=key(0), data=block(0), meta=bytes(MAX_META_BYTES + 1)),
        ):
            with pytest.raises(ValueError):
                t.write_behind(on_done=outcomes.for_block(0), **bad)
            with pytest.raises(ValueError):
                t.put(**bad)
        t.flush()
        assert outcomes.calls == {} and len(t) == 0


def test_meta_is_kept_with_the_block_and_told_in_events(tmp_path):
    events = []
    big = bytes(range(256)) * (MAX_META_BYTES // 256)
    on_event = lambda kind, h, meta: events.append((kind, h, meta))  # noqa: E731
    with tier(tmp_path, capacity_blocks=3, on_event=on_event) as t:
        t.put(key(0), block(0), meta=b"zero")
        t.write_behind(key(1), block(1), meta=big)
        assert t.get_meta(key(1)) == big  # pending
        t.put(key(2), block(2))
        t.flush()
        assert [t.get_meta(key(i)) for i in range(4)] == [b"zero", big, b"", None]
        t.put(key(3), block(3), meta=b"three")  # evicts block 0, the oldest
        t.flush()
    assert events == [
        ("stored", key(0), b"zero"),
        ("stored", key(1), big),
        ("stored", key(2), b""),
        ("removed", key(0), b"zero"),
        ("stored", key(3), b"three"),
    ]
    with tier(tmp_path, capacity_blocks=3) as t:
        assert [t.get_meta(key(i)) for i in range(4)] == [None, big, b"", b"three"]
        assert np.array_equal(read(t, 1), block(1))


def test_scan_pages_through_committed_blocks_in_key_order(tmp_path):
    with tier(tmp_path, flush_interval_s=3600) as t:
        for i in range(10):
            t.put(key(i), block(i), meta=b"%d" % i)
        t.flush()
        t.put(key(10), block(10), meta=b"pending")  # lingers: not committed, not scanned
        everything = t.scan(None, 100)
        assert everything == sorted((key(i), b"%d" % i) for i in range(10))
        pages, after = [], None
        while page := t.scan(after, 3):
            pages.append(page)
            after = page[-1][0]
        assert [len(p) for p in pages] == [3, 3, 3, 1]
        assert [pair for p in pages for pair in p] == everything
        assert t.scan(everything[4][0], 2) == everything[5:7]
        assert t.scan(bytes(16), 0) == []
        with pytest.raises(ValueError):
            t.scan(b"short", 1)
        with pytest.raises(ValueError):
            t.scan(None, -1)


def test_format_2_directory_opens_with_empty_meta(tmp_path):
    with tier(tmp_path) as t:
        for i in range(5):
            t.put(key(i), block(i), meta=b"new")
    # Rewrite every entry as kvtier wrote it before meta existed: format 2, no meta.
    env = lmdb.open(str(tmp_path), max_dbs=3)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:
        for k, v in list(txn.cursor()):
            fields = list(_ENTRY.unpack(v[: _ENTRY.size]))
            txn.put(k, _ENTRY.pack(2, *fields[1:]))
    env.close()
    with tier(tmp_path) as t:
        assert len(t) == 5
        assert [t.get_meta(key(i)) for i in range(5)] == [b""] * 5
        assert t.scan(None, 10) == sorted((key(i), b"") for i in range(5))
        assert np.array_equal(read(t, 2), block(2))  # a read rewrites it in today's format
        t.flush()
        with t._s.index.read() as txn:
            assert int.from_bytes(bytes(txn.get(key(2)))[:2], "big") == FORMAT_VERSION


def test_lingering_stores_share_one_commit(tmp_path):
    with tier(tmp_path, flush_interval_s=3600) as t:
        before = t._s.index.env.info()["last_txnid"]
        for i in range(6):
            t.write_behind(key(i), block(i))
        t.flush()
        assert t._s.index.env.info()["last_txnid"] == before + 1


def test_stores_commit_within_the_interval_without_a_flush(tmp_path):
    outcomes = Outcomes()
    with tier(tmp_path, flush_interval_s=0.05) as t:
        for i in range(3):
            t.write_behind(key(i), block(i), on_done=outcomes.for_block(i))
        outcomes.wait(3)  # no flush, no close: the interval alone commits them
        assert outcomes.calls == {i: [True] for i in range(3)}


def test_on_done_is_held_while_a_reader_copies_the_borrowed_bytes(tmp_path):
    outcomes = Outcomes()
    with tier(tmp_path) as t:
        t.write_behind(key(0), block(0), on_done=outcomes.for_block(0))
        with t._s.lock:
            pending = t._s.pending[key(0)]
            pending.readers += 1  # a reader in the middle of its copy
        flusher = threading.Thread(target=t.flush)
        flusher.start()
        deadline = time.monotonic() + 60
        while t.counters.used_blocks == 0:  # until the writer has committed the block
            assert time.monotonic() < deadline, "the block was never committed"
            time.sleep(0.01)
        assert flusher.is_alive() and outcomes.calls == {}  # held for the reader
        with t._s.lock:
            pending.readers -= 1
            t._s.drained.notify_all()
        flusher.join()
        assert outcomes.calls == {0: [True]}


_DURABLE = """
import os, signal, sys, threading
import numpy as np, xxhash
from kvtier.tiers.disk.tier import DiskTier
sig, size, count = bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = DiskTier(sys.argv[1], sig, size, 64 * size, flush_interval_s=0.01)
told = threading.Semaphore(0)
rows = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]
for i, row in enumerate(rows):
    t.write_behind(xxhash.xxh3_128_digest(i.to_bytes(8, "little")), row,
                   on_done=lambda ok: ok and told.release())
for _ in range(count):
    told.acquire()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_on_done_true_survives_sigkill(tmp_path):
    run_until_killed(_DURABLE, tmp_path, count=12, timeout=120)
    assert_holds_exactly(tmp_path, 12)
