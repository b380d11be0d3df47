"""The disk tier: blocks in one data file on local NVMe, indexed by LMDB, under a byte budget with
LRU.

Block bytes live in ``blocks.dat``, a preallocated file of fixed slots written and read with
``O_DIRECT``, around the page cache (``disk_slots``). LMDB holds only small entries: per block
its slot, layout signature, length and xxh3_64 checksum, and the access order (``disk_index``).
The free slots are the ones no entry names, worked out at open. Reopening a directory recovers
every committed block and its recency; one made with another budget is grown or evicted down.

One writer thread owns every write: ``put`` copies the block into a page-aligned buffer, parks
it in a pending map (readable at once) and queues it; the writer drains its queue into one
batch, writes the batch's payloads into free slots, ``fdatasync``s the data file and only then
commits the entries that point at them, so an entry never names bytes that are not on the
device. Evictions ride in the same commit and an evicted block's slot is reused only by a
later batch, so the file holds one batch of spare slots beyond the budget.

Readers look the entry up and pin its slot in one critical section, then read the slot
straight into the caller's buffer; a slot freed meanwhile is not reused until they unpin it
(``SlotTable``). Every read is checked against the entry's checksum: a mismatch is a miss,
counted and dropped, never data.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import xxhash

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk_index import FORMAT_VERSION, BlockIndex, Entry
from kvtier.tiers.disk_recovery import recover
from kvtier.tiers.disk_slots import BufferPool, SlotFile, SlotTable, slot_stride
from kvtier.tiers.hashing import check_hash

log = logging.getLogger(__name__)

DATA_FILE = "blocks.dat"
_SIGNATURE_BYTES = 16
# A batch takes at most this many bytes of new blocks (and at most an eighth of the budget):
# enough to amortise its fdatasync and commit; it is also the number of spare slots.
_MAX_BATCH_BYTES = 64 << 20
# How many batches of returned put buffers the pool keeps warm.
_POOL_BATCHES = 2
# Map bytes per slot for its index and order entries, B-tree pages and free lists, with room
# to spare, plus a slack for meta pages; the default map is never below _MAP_FLOOR. The map is
# address space only: the file grows as used.
_INDEX_BYTES = 2048
_MAP_SLACK = 256 << 10
_MAP_FLOOR = 64 << 20

# Writer queue operations; the ones below _FLUSH change the database.
_MAX_DEFERRED_TOUCHES = 4096
_PUT, _TOUCH, _DROP, _FLUSH, _STOP = range(5)

_open_paths: set[str] = set()
_open_paths_lock = threading.Lock()


class _Flush:
    """A flush marker: set by the writer once every operation queued before it is committed."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()


class _Pending:
    """A put not yet committed: its aligned buffer, checksum and the readers copying from it."""

    __slots__ = ("buf", "checksum", "readers", "retired")

    def __init__(self, buf: Any, checksum: int) -> None:
        self.buf = buf
        self.checksum = checksum
        self.readers = 0
        self.retired = False  # committed or given up; the buffer goes back once unread


class DiskTier:
    """Blocks of ``block_bytes`` bytes in the directory ``path``, LRU within a budget.

    ``capacity_bytes`` bounds the payload bytes kept (whole blocks); the data file is sized to
    it (plus one batch of spare slots) at open. ``on_event(kind, hash)`` is called from the
    writer thread, outside any lock, with ``"stored"`` after a block is committed and
    ``"removed"`` after one is evicted or dropped (blocks found or dropped at start-up are not
    announced). ``sync=False`` skips the fdatasync and fsyncs at each commit: committed blocks
    then survive a crash of the process, not one of the machine. A ``map_size`` too small for
    the budget's index lowers the budget.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout_signature: bytes,
        block_bytes: int,
        capacity_bytes: int,
        counters: TierCounters | None = None,
        on_event: Callable[[str, bytes], None] | None = None,
        *,
        sync: bool = True,
        map_size: int | None = None,
    ) -> None:
        if len(layout_signature) != _SIGNATURE_BYTES:
            raise ValueError(f"layout signature must be {_SIGNATURE_BYTES} bytes")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self._capacity_blocks, self._batch_blocks, map_size = _plan(
            block_bytes, capacity_bytes, map_size
        )
        self._total_slots = self._capacity_blocks + self._batch_blocks
        self.block_bytes = block_bytes
        self.counters = counters if counters is not None else TierCounters(tier="disk")
        self._signature = bytes(layout_signature)
        self._on_event = on_event
        self._sync = sync
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._queue: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._closed = False
        self._writer_alive = True
        self._failure: BaseException | None = None  # the writer's, not yet told to a flush
        stride = slot_stride(block_bytes)
        self._pool = BufferPool(stride, min(self._total_slots, _POOL_BATCHES * self._batch_blocks))

        self._path = os.path.realpath(path)
        with _open_paths_lock:
            if self._path in _open_paths:
                raise RuntimeError(
                    f"disk tier {self._path} is already open in this process; "
                    "close it before opening it again"
                )
            _open_paths.add(self._path)
        self._index: BlockIndex | None = None
        self._slots: SlotFile | None = None
        try:
            os.makedirs(self._path, exist_ok=True)
            self._index = BlockIndex(self._path, map_size=map_size, sync=sync)
            self._slots = SlotFile(os.path.join(self._path, DATA_FILE), stride, self._pool)
            self._table = SlotTable(self._lock, self._recover())
        except BaseException:
            if self._slots is not None:
                self._slots.close()
            if self._index is not None:
                self._index.close()
            with _open_paths_lock:
                _open_paths.discard(self._path)
            raise

        c = self.counters
        c.capacity_blocks = self._capacity_blocks
        c.capacity_bytes = self._capacity_blocks * block_bytes
        self._writer = threading.Thread(target=self._run, name="kvtier-disk-writer", daemon=True)
        self._writer.start()

    # ---- readers (any thread) ----

    def __len__(self) -> int:
        with self._lock:
            return self.counters.used_blocks + len(self._pending)

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is committed or waiting in the writer's queue."""
        return self.lookup_prefix((block_hash,)) == 1

    def lookup_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` this tier holds, read in one short transaction."""
        for h in hashes:
            check_hash(h)
        # Pending first, LMDB second: the writer commits before it forgets a pending block,
        # so a block leaving the pending map is already visible to a transaction begun later.
        with self._lock:
            pending = [h in self._pending for h in hashes]
        with self._index.read() as txn:
            for n, (h, is_pending) in enumerate(zip(hashes, pending, strict=True)):
                if not is_pending and not self._index.has(txn, h):
                    return n
        return len(hashes)

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
            pending = self._pending.get(block_hash)
            if pending is not None:
                pending.readers += 1
            else:
                # Looked up and pinned in the critical section that frees slots (SlotTable).
                with self._index.read() as txn:
                    entry = self._index.get(txn, block_hash)
                if entry is None:
                    return False
                slot = entry.slot
                self._table.pin_locked(slot)
        if pending is not None:
            try:
                dst[:] = memoryview(pending.buf)[: self.block_bytes]
            finally:
                self._unpin_pending(pending)
            self._count_load()
            return True
        valid = self._valid(entry)
        try:
            if valid:
                self._slots.read_into(slot, dst)
        except OSError as exc:  # the device failed this read: a miss, and the entry stays
            log.warning("disk tier %s: reading slot %d failed: %s", self._path, slot, exc)
            return False
        finally:
            self._table.unpin(slot)
        if valid and xxhash.xxh3_64_intdigest(dst) == entry.checksum:
            self._count_load()
            self._enqueue(_TOUCH, block_hash)
            return True
        log.warning("disk tier %s: corrupt block %s dropped", self._path, block_hash.hex())
        with self._lock:
            self.counters.checksum_failures += 1
        self._enqueue(_DROP, (block_hash, slot))
        return False

    # ---- writers (any thread) ----

    def put(self, block_hash: bytes, data: Any) -> None:
        """Stores a copy of ``data`` (a C-contiguous buffer of ``block_bytes``) under the hash.

        The bytes are copied before this returns and are readable at once; the writer thread
        commits them later (``flush`` waits for that). A block already held is left as it is.
        """
        check_hash(block_hash)
        src = memoryview(data).cast("B")
        if src.nbytes != self.block_bytes:
            raise ValueError(f"block must be {self.block_bytes} bytes, got {src.nbytes}")
        with self._lock:
            self._check_open()
        if self.contains(block_hash):
            return
        # Our one copy of the payload, into a page-aligned buffer that the writer hands to
        # O_DIRECT as it is.
        buf = self._pool.acquire()
        with memoryview(buf) as view:
            payload = view[: self.block_bytes]
            payload[:] = src
            pending = _Pending(buf, xxhash.xxh3_64_intdigest(payload))
            payload.release()
        with self._lock:
            self._check_open()
            if block_hash not in self._pending:
                self._pending[block_hash] = pending
                self._queue.put((_PUT, block_hash))
                return
        self._pool.release(buf)

    def flush(self, timeout: float | None = None) -> None:
        """Blocks until everything queued before this call is committed.

        Raises ``TimeoutError`` after ``timeout`` seconds, and ``RuntimeError`` if the writer
        failed to commit that work or is no longer running.
        """
        marker = _Flush()
        with self._lock:
            self._check_open()
            self._queue.put((_FLUSH, marker))
        if not marker.done.wait(timeout):
            raise TimeoutError(f"disk tier {self._path}: flush did not finish in {timeout} s")
        if marker.error is not None:
            raise RuntimeError(f"disk tier {self._path}: writer failed") from marker.error

    def close(self) -> None:
        """Commits everything queued, stops the writer and closes the files (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._writer_alive:
                self._queue.put((_STOP, None))
        self._writer.join()
        if not self._sync:
            self._slots.sync()
            self._index.sync()
        self._slots.close()
        self._index.close()
        self._pool.clear()
        with _open_paths_lock:
            _open_paths.discard(self._path)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers for any thread ----

    def _check_open(self) -> None:
        """Raises unless the writer can still take work; call with ``_lock`` held."""
        if self._closed:
            raise RuntimeError(f"disk tier {self._path} is closed")
        if not self._writer_alive:
            raise RuntimeError(f"disk tier {self._path}: writer thread is not running")

    def _enqueue(self, op: int, arg: Any) -> None:
        with self._lock:
            if not self._closed and self._writer_alive:
                self._queue.put((op, arg))

    def _count_load(self) -> None:
        with self._lock:
            self.counters.blocks_loaded += 1
            self.counters.bytes_out += self.block_bytes

    def _valid(self, entry: Entry) -> bool:
        """Whether an entry can name one of this tier's blocks."""
        return (
            entry.signature == self._signature
            and entry.length == self.block_bytes
            and 0 <= entry.slot < self._total_slots
        )

    def _unpin_pending(self, pending: _Pending) -> None:
        with self._lock:
            pending.readers -= 1
            if pending.retired and not pending.readers:
                self._pool.release(pending.buf)

    # ---- start-up ----

    def _recover(self) -> list[int]:
        """Recovers the directory's blocks (see ``recover``); returns the free slots."""
        found = recover(
            self._index,
            self._slots,
            self._pool,
            signature=self._signature,
            block_bytes=self.block_bytes,
            capacity_blocks=self._capacity_blocks,
            total_slots=self._total_slots,
        )
        if found.dropped:
            log.warning(
                "disk tier %s: dropped %d blocks stored for another layout or format",
                self._path,
                found.dropped,
            )
        if found.moved:
            log.info("disk tier %s: moved %d blocks into the smaller file", self._path, found.moved)
        c = self.counters
        c.blocks_evicted += found.dropped + found.evicted
        c.checksum_failures += found.lost
        c.used_blocks = found.used
        c.used_bytes = c.used_blocks * self.block_bytes
        return found.free_slots

    # ---- the writer thread ----

    def _run(self) -> None:
        batch: list[tuple[int, Any]] = []
        touches: list[tuple[int, Any]] = []
        try:
            stop = False
            while not stop:
                batch = self._next_batch()
                stop = any(op == _STOP for op, _ in batch)
                # Access-order bumps alone are not worth a synced commit per read burst: they
                # ride along with the next commit that stores, drops or flushes. A crash loses
                # only some LRU precision, never a block.
                if len(touches) + len(batch) < _MAX_DEFERRED_TOUCHES and all(
                    op == _TOUCH for op, _ in batch
                ):
                    touches += batch
                    continue
                batch, touches = touches + batch, []
                self._process(batch)
        finally:
            with self._lock:
                self._writer_alive = False
            # Nothing can be queued any more; release the flushes that would otherwise wait
            # forever, in the batch this thread may have died in and in the queue.
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for op, arg in batch:
                if op == _FLUSH and not arg.done.is_set():
                    arg.finish(RuntimeError("disk tier writer stopped"))

    def _next_batch(self) -> list[tuple[int, Any]]:
        """Blocks for one operation, then takes whatever else is queued, up to a batch of puts."""
        batch = [self._queue.get()]
        puts = batch[0][0] == _PUT
        while puts < self._batch_blocks:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
            puts += item[0] == _PUT
        return batch

    def _process(self, batch: list[tuple[int, Any]]) -> None:
        """Commits one batch, tells ``on_event``, then releases the batch's flush markers
        (with the error of this batch or of any since the last flush)."""
        events: list[tuple[str, bytes]] = []
        try:
            events = self._commit([item for item in batch if item[0] < _FLUSH])
        except Exception as exc:  # one failed batch (an I/O error) must not stop the writer
            log.exception("disk tier %s: write of %d operations failed", self._path, len(batch))
            self._failure = exc
            self._forget(batch)
        if self._on_event is not None:
            for kind, block_hash in events:
                try:
                    self._on_event(kind, block_hash)
                except Exception:  # a subscriber's bug must not stop the disk tier
                    log.exception("disk tier %s: on_event(%r) failed", self._path, kind)
        error, flushed = self._failure, False
        for op, marker in batch:
            if op == _FLUSH:
                marker.finish(error)
                flushed = True
        if flushed:
            self._failure = None

    def _commit(self, ops: list[tuple[int, Any]]) -> list[tuple[str, bytes]]:
        """Writes ``ops`` in one transaction and returns the events to report.

        The batch's payloads go into their slots, and are made durable, inside the transaction
        and before it commits. A full map (a reader pinning an old snapshot keeps freed pages
        from reuse) is answered by evicting the oldest blocks in a commit of their own and
        trying again. LMDB reuses the pages a commit frees only once another commit has
        followed it, so with nothing left to evict one marker commit goes first. If even that
        finds no room, the batch is given up with an error in the log (its blocks are not
        stored), never raised to a caller.
        """
        events: list[tuple[str, bytes]] = []
        marked = False
        while True:
            taken: list[int] = []
            try:
                with self._index.write() as txn:
                    changes, writes, freed = self._apply(txn, ops, taken)
                    if writes:
                        self._slots.write(writes)
                        if self._sync:
                            self._slots.sync()
                    del writes  # no view of a pending buffer outlives the batch
            except lmdb.MapFullError:
                self._table.free(taken)
                puts = sum(op == _PUT for op, _ in ops)
            except BaseException:
                self._table.free(taken)
                raise
            else:
                # Only now, with their deletions committed, may a later batch reuse these.
                self._table.free(freed)
                return events + self._publish(changes, ops)
            try:
                with self._index.write() as txn:
                    evicted = self._index.evict(txn, max(puts, 1))
                    mark = not evicted and not marked
                    if mark:
                        self._index.mark(txn)
            except lmdb.MapFullError:
                evicted, mark = [], False
            if evicted or mark:
                marked = marked or mark
                self._table.free([slot for _, slot in evicted])
                events += self._publish([("evicted", h) for h, _ in evicted], [])
                continue
            log.error("disk tier %s: map full, %d blocks not stored", self._path, puts)
            self._forget(ops)
            return events

    def _apply(
        self, txn: lmdb.Transaction, ops: list[tuple[int, Any]], taken: list[int]
    ) -> tuple[list[tuple[str, bytes]], list[tuple[int, memoryview]], list[int]]:
        """Applies puts, access bumps and drops to the index, in order.

        Returns what changed (in order), the payload writes to make before the commit and the
        slots the commit frees; the slots given to puts go into ``taken`` as they are taken.
        """
        changes: list[tuple[str, bytes]] = []
        writes: list[tuple[int, memoryview]] = []
        freed: list[int] = []
        used = self.counters.used_blocks  # only this thread changes it
        for op, arg in ops:
            block_hash = arg[0] if op == _DROP else arg
            entry = self._index.get(txn, block_hash)
            if op == _PUT:
                if entry is not None:
                    continue
                for evicted, slot in self._index.evict(txn, used + 1 - self._capacity_blocks):
                    changes.append(("evicted", evicted))
                    freed.append(slot)
                    used -= 1
                slot = self._table.take()
                taken.append(slot)
                with self._lock:
                    pending = self._pending[block_hash]
                writes.append((slot, memoryview(pending.buf)))
                new = Entry(FORMAT_VERSION, 0, slot, self._signature, self.block_bytes, 0)
                self._index.insert(txn, block_hash, new._replace(checksum=pending.checksum))
                changes.append(("stored", block_hash))
                used += 1
            elif entry is None:
                continue
            elif op == _TOUCH:
                self._index.touch(txn, block_hash, entry)
            elif entry.slot == arg[1]:  # not a copy stored again since the bad read
                self._index.delete(txn, block_hash, entry)
                if entry.slot >= 0:
                    freed.append(entry.slot)
                changes.append(("dropped", block_hash))
                used -= 1
        return changes, writes, freed

    def _publish(
        self, changes: list[tuple[str, bytes]], ops: list[tuple[int, Any]]
    ) -> list[tuple[str, bytes]]:
        """After a commit: counts the changes, forgets committed puts, returns public events."""
        c = self.counters
        with self._lock:
            for kind, _ in changes:
                if kind == "stored":
                    c.blocks_stored += 1
                    c.bytes_in += self.block_bytes
                    c.used_blocks += 1
                else:
                    c.blocks_evicted += kind == "evicted"
                    c.used_blocks -= 1
            c.used_bytes = c.used_blocks * self.block_bytes
        self._forget(ops)
        return [("stored" if kind == "stored" else "removed", h) for kind, h in changes]

    def _forget(self, ops: list[tuple[int, Any]]) -> None:
        """Takes the batch's puts out of the pending map (committed, or lost to an error); a
        buffer goes back to the pool once nobody is copying from it."""
        with self._lock:
            for op, block_hash in ops:
                if op == _PUT:
                    pending = self._pending.pop(block_hash, None)
                    if pending is not None:
                        pending.retired = True
                        if not pending.readers:
                            self._pool.release(pending.buf)


def _plan(block_bytes: int, capacity_bytes: int, map_size: int | None) -> tuple[int, int, int]:
    """Returns (budget in blocks, most puts per batch = spare slots, map size in bytes)."""
    capacity = capacity_bytes // block_bytes
    if map_size is not None:
        capacity = min(capacity, (map_size - _MAP_SLACK) // _INDEX_BYTES)
    if capacity < 1:
        raise ValueError(
            f"capacity {capacity_bytes} B or map size {map_size} B holds no block of "
            f"{block_bytes} B"
        )
    batch = max(1, min(_MAX_BATCH_BYTES // block_bytes, capacity // 8))
    if map_size is None:
        map_size = max(_MAP_FLOOR, _MAP_SLACK + (capacity + batch) * _INDEX_BYTES)
    return capacity, batch, map_size
