"""The disk tier: blocks in one data file on local NVMe, indexed by LMDB, under a byte budget with
LRU.

The pieces: ``slots`` (the preallocated slot file, O_DIRECT), ``index`` (LMDB entries:
slot, signature, length, checksum, meta; and the access order), ``writer`` and
``commit`` (a writer thread batching stores, a thread committing them), ``recovery``
(opening, budget changes) and ``directory`` (one owner per directory, damage moved aside).

Stores wait in a pending map, readable at once, until the writer commits them: ``put`` copies
the caller's bytes first, ``write_behind`` borrows them until it calls back. Readers look the
entry up and pin its slot in one critical section, then read the slot straight into the
caller's buffer; a slot freed meanwhile is not reused until they unpin it (``SlotTable``).
Every read is checked against the entry's checksum: a mismatch is a miss, counted and dropped,
never data.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import xxhash

from kvtier.tiers.buffers import copy_bytes
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk.commit import DROP, FLUSH, PUT, STOP, TOUCH, Pending, check_block
from kvtier.tiers.disk.directory import TierDirectory
from kvtier.tiers.disk.index import MAX_META_BYTES, UNREADABLE, BlockIndex, Entry
from kvtier.tiers.disk.recovery import open_state, plan
from kvtier.tiers.disk.slots import DATA_FILE
from kvtier.tiers.disk.writer import DiskWriter, Flush
from kvtier.tiers.hashing import check_hash

__all__ = ["DATA_FILE", "MAX_META_BYTES", "DiskTier"]

log = logging.getLogger(__name__)

_SIGNATURE_BYTES = 16
# What ``write_behind`` found before queueing a block.
_JOINED, _REFUSED, _HELD = "joined", "refused", "held"


class DiskTier:
    """Blocks of ``block_bytes`` bytes in the directory ``path``, LRU within a budget.

    ``capacity_bytes`` bounds the payload bytes kept (whole blocks); the data file is sized to
    it (plus spare slots: ``plan``) at open. ``on_event(kind, hash, meta)`` is called from
    the commit thread, outside any lock, with ``"stored"`` after a block is committed and
    ``"removed"`` after one is evicted or dropped (blocks found or dropped at start-up are not
    announced). A ``map_size`` too small for the budget's index lowers the budget.

    Durability: a store is committed in a batch at most ``flush_interval_s`` after it was
    queued (while the device keeps up); ``on_done(True)`` and "stored" come after the commit.
    With ``sync`` (the default) a commit fdatasyncs the data file before LMDB commits, and
    LMDB syncs its own: committed blocks survive a power loss. ``sync=False`` skips both:
    committed blocks survive a crash of the process, not one of the machine. After a SIGKILL,
    every committed block is found again, exact, and no entry ever names bytes that were not
    written; stores still queued or in an uncommitted batch are lost (a cache: they cost a
    recompute).

    ``read_delay_s`` slows every read from the device by that much: a fault-injection knob
    for tests and demonstrations of a crawling disk, 0 in service. ``clock`` (wall-clock
    seconds) dates the access order, for ``oldest_block_age_s``.

    Opening takes the directory for this process (``DirectoryInUse`` names the holder's pid)
    and moves a damaged index aside, logging where, then starts empty.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout_signature: bytes,
        block_bytes: int,
        capacity_bytes: int,
        counters: TierCounters | None = None,
        on_event: Callable[[str, bytes, bytes], None] | None = None,
        *,
        sync: bool = True,
        map_size: int | None = None,
        flush_interval_s: float = 1.0,
        read_delay_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if len(layout_signature) != _SIGNATURE_BYTES:
            raise ValueError(f"layout signature must be {_SIGNATURE_BYTES} bytes")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if not flush_interval_s >= 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        if not read_delay_s >= 0:
            raise ValueError(f"read_delay_s must be >= 0, got {read_delay_s}")
        self._read_delay_s = read_delay_s
        capacity, batch, map_size = plan(block_bytes, capacity_bytes, map_size)
        self.block_bytes = block_bytes
        self.counters = counters if counters is not None else TierCounters(tier="disk")
        self._sync = sync
        self._closed = False
        self._dir = TierDirectory(os.path.realpath(path))
        signature = bytes(layout_signature)
        index = functools.partial(BlockIndex, map_size=map_size, sync=sync, clock=clock)
        try:
            self._s = open_state(
                self._dir, signature, block_bytes, capacity, batch, index, self.counters
            )
        except BaseException:
            self._dir.release()
            raise
        self._lock = self._s.lock
        self._writer = DiskWriter(self._s, capacity, batch, sync, flush_interval_s, on_event)

    # ---- readers (any thread) ----

    def __len__(self) -> int:
        with self._lock:
            return self.counters.used_blocks + len(self._s.pending)

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is committed or waiting in the writer's queue."""
        return self.lookup_prefix((block_hash,)) == 1

    def holding(self, hashes: Sequence[bytes]) -> set[bytes]:
        """Which of ``hashes`` this tier holds (committed or queued), read in one short
        transaction however many are asked."""
        for h in hashes:
            check_hash(h)
        # Pending first, LMDB second, as in ``lookup_prefix``.
        with self._lock:
            held = {h for h in hashes if h in self._s.pending}
        rest = [h for h in hashes if h not in held]
        if rest:
            with self._s.index.read() as txn:
                held.update(h for h in rest if self._s.index.has(txn, h))
        return held

    def lookup_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` this tier holds, read in one short transaction."""
        for h in hashes:
            check_hash(h)
        # Pending first, LMDB second: the writer commits before it forgets a pending block,
        # so a block leaving the pending map is already visible to a transaction begun later.
        with self._lock:
            pending = [h in self._s.pending for h in hashes]
        with self._s.index.read() as txn:
            for n, (h, is_pending) in enumerate(zip(hashes, pending, strict=True)):
                if not is_pending and not self._s.index.has(txn, h):
                    return n
        return len(hashes)

    def oldest_block_age_s(self) -> float | None:
        """Seconds since the least recently used committed block was last used: an upper
        bound, about a second over (``clock``); 0.0 when empty; None when no time dates that
        block (written by a version that kept none) or the tier is closed."""
        try:
            return self._s.index.oldest_age_s()
        except lmdb.Error:
            return None

    def get_meta(self, block_hash: bytes) -> bytes | None:
        """The meta stored with the block, None if this tier does not hold it."""
        check_hash(block_hash)
        with self._lock:
            pending = self._s.pending.get(block_hash)
            if pending is not None:
                return pending.meta
        with self._s.index.read() as txn:
            entry = self._s.index.get(txn, block_hash)
        return None if entry is None or entry is UNREADABLE else entry.meta

    def scan(self, after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` committed (hash, meta) pairs in hash order after ``after`` (from the
        first when None), read in one short transaction: page through a warm tier with the
        last hash of one call as ``after`` of the next."""
        if after is not None:
            check_hash(after)
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return self._s.index.scan(after, limit)

    def get_into(self, block_hash: bytes, out: Any) -> bool:
        """Copies the block into ``out`` (a writable buffer of ``block_bytes``); False on a miss.

        A stored block whose entry or checksum does not match is a miss: it is counted in
        ``checksum_failures`` and dropped, and ``out`` then holds no meaningful bytes.
        """
        check_hash(block_hash)
        dst = memoryview(out).cast("B")
        if dst.readonly or dst.nbytes != self.block_bytes:
            raise ValueError(f"out must be a writable buffer of {self.block_bytes} bytes")
        with self._lock:
            pending = self._s.pending.get(block_hash)
            if pending is not None:
                pending.readers += 1
            else:
                # Looked up and pinned in the critical section that frees slots (SlotTable).
                with self._s.index.read() as txn:
                    entry = self._s.index.get(txn, block_hash)
                if entry is None:
                    return False
                slot = entry.slot
                self._s.table.pin_locked(slot)
        if pending is not None:
            try:
                copy_bytes(dst, pending.data)
            finally:
                with self._lock:
                    pending.readers -= 1
                    if not pending.readers:
                        self._s.drained.notify_all()
            self._count_load()
            return True
        valid = self._valid(entry)
        started = time.perf_counter()
        try:
            if valid:
                if self._read_delay_s:
                    time.sleep(self._read_delay_s)
                self._s.slots.read_into(slot, dst)
        except OSError as exc:  # the device failed this read: a miss, and the entry stays
            self._s.failures.warning(
                "read", "disk tier %s: reading slot %d failed: %s", self._s.path, slot, exc
            )
            return False
        finally:
            self._s.table.unpin(slot)
        if valid and xxhash.xxh3_64_intdigest(dst) == entry.checksum:
            self._count_load(time.perf_counter() - started)
            self._enqueue(TOUCH, block_hash)
            return True
        log.warning("disk tier %s: corrupt block %s dropped", self._s.path, block_hash.hex())
        with self._lock:
            self.counters.checksum_failures += 1
        self._enqueue(DROP, (block_hash, slot))
        return False

    # ---- writers (any thread) ----

    def put(self, block_hash: bytes, data: Any, meta: bytes = b"", shed: bool = True) -> bool:
        """Stores a copy of ``data`` (a C-contiguous buffer of ``block_bytes``) and ``meta``;
        False if it dropped the block instead, as ``shed`` lets it when the writer is far behind
        (``DiskState.shed``). The copy is made before this returns and is readable at once; the
        writer commits it later (``flush`` waits for that). A block already held is left as it
        is. Raises ``RuntimeError`` once the tier is closed."""
        src, meta = check_block(block_hash, data, meta, self.block_bytes)
        with self._lock:
            self._check_open()
            if shed and block_hash not in self._s.pending and self._s.shed():
                return False
        if self.contains(block_hash):
            return True
        # Our one copy of the payload: page-aligned, the writer hands it to O_DIRECT as it is.
        buf = self._s.pool.acquire()
        view = memoryview(buf)[: self.block_bytes]
        copy_bytes(view, src)
        with self._lock:
            self._check_open()
            if block_hash not in self._s.pending:
                self._s.pending[block_hash] = Pending(view, buf, meta, None)
                self._s.copied_bytes += self.block_bytes
                self._writer.submit(PUT, block_hash)
                return True
        view.release()
        self._s.pool.release(buf)
        return True

    def write_behind(
        self,
        block_hash: bytes,
        data: Any,
        meta: bytes = b"",
        on_done: Callable[[bool], None] | None = None,
    ) -> None:
        """Stores ``data`` (a C-contiguous buffer of ``block_bytes``) without copying it here.

        The caller keeps ``data`` alive and unchanged until ``on_done(ok)``, which is called
        exactly once: True once the block is committed (durable as ``sync`` says) or at once
        if the tier already holds it, False if it was not stored (I/O error, full map, tier
        closed; counted in ``blocks_dropped``). It runs on this thread or the tier's, must
        not block and must not call into this tier. The block is readable at once. Bad
        arguments raise ``ValueError`` and call nothing.
        """
        src, meta = check_block(block_hash, data, meta, self.block_bytes)
        done = on_done if on_done is not None else _ignore
        with self._lock:
            outcome = self._join_or_refuse(block_hash, done)
        if outcome is None and self._committed(block_hash):
            outcome = _HELD
        if outcome is None:
            with self._lock:
                outcome = self._join_or_refuse(block_hash, done)
                if outcome is None:
                    self._s.pending[block_hash] = Pending(src, None, meta, done)
                    self._writer.submit(PUT, block_hash)
                    return
        if outcome != _JOINED:
            done(outcome == _HELD)

    def flush(self, timeout: float | None = None) -> None:
        """Blocks until everything queued before this call is done, their ``on_done`` called.

        A flush reports only its own trouble, never a block's (``on_done`` does that): it
        raises ``TimeoutError`` after ``timeout`` seconds, and ``RuntimeError`` if the tier is
        closed or its writer stopped.
        """
        marker = Flush()
        with self._lock:
            self._check_open()
            self._writer.submit(FLUSH, marker)
        if not marker.done.wait(timeout):
            raise TimeoutError(f"disk tier {self._s.path}: flush did not finish in {timeout} s")
        if marker.error is not None:
            raise RuntimeError(f"disk tier {self._s.path}: writer stopped") from marker.error

    def close(self) -> None:
        """Commits everything queued, stops the writer, closes the files and gives up the
        directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._writer.alive:
                self._writer.submit(STOP, None)
        self._writer.join()
        if not self._sync:
            self._s.slots.sync()
            self._s.index.sync()
        self._s.slots.close()
        self._s.index.close()
        self._s.pool.clear()
        self._dir.mark_clean()
        self._dir.release()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers for any thread ----

    def _check_open(self) -> None:
        """Raises unless the writer can still take work; call with ``_lock`` held."""
        if self._closed:
            raise RuntimeError(f"disk tier {self._s.path} is closed")
        if not self._writer.alive:
            raise RuntimeError(f"disk tier {self._s.path}: writer thread is not running")

    def _join_or_refuse(self, block_hash: bytes, on_done: Callable[[bool], None]) -> str | None:
        """With ``_lock`` held: ``_JOINED`` if the block is already queued (``on_done`` then
        hears its outcome), ``_REFUSED`` if the tier takes no more work (counted and logged
        here; the caller tells ``on_done``), else None."""
        pending = self._s.pending.get(block_hash)
        if pending is not None:
            pending.callbacks.append(on_done)
            return _JOINED
        if self._closed or not self._writer.alive:
            self.counters.blocks_dropped += 1
            self._s.failures.warning(
                "closed", "disk tier %s: closed, a block was not stored", self._s.path
            )
            return _REFUSED
        return None

    def _committed(self, block_hash: bytes) -> bool:
        try:
            with self._s.index.read() as txn:
                return self._s.index.has(txn, block_hash)
        except lmdb.Error:  # closed meanwhile: the caller's next check refuses the block
            return False

    def _enqueue(self, op: int, arg: Any) -> None:
        with self._lock:
            if not self._closed and self._writer.alive:
                self._writer.submit(op, arg)

    def _count_load(self, device_s: float | None = None) -> None:
        """Counts one block read out; ``device_s``: the time a read from the device took
        (a read of a pending block is a memory copy, not the device's rate)."""
        with self._lock:
            self.counters.blocks_loaded += 1
            self.counters.bytes_out += self.block_bytes
            if device_s is not None:
                self.counters.observe_read(self.block_bytes, device_s)

    def _valid(self, entry: Entry) -> bool:
        """Whether an entry can name one of this tier's blocks."""
        return (
            entry.signature == self._s.signature
            and entry.length == self.block_bytes
            and 0 <= entry.slot < self._s.total_slots
        )


def _ignore(ok: bool) -> None:
    """The ``on_done`` of a caller that does not need to know."""
