"""One batch of the disk tier's writes, applied in one LMDB transaction by the writer thread.

A batch's payloads go into free slots as its stores arrive (``stage``), while the batch still
gathers, so that the device writes while the callers produce rather than after; they are made
durable (``fdatasync``) inside the transaction, before it commits, so an entry never names bytes
that are not on the device. Evictions ride in the same commit, and the slots they free are
reused only by a later batch. A batch is sealed (``seal``) when it closes and committed on
a thread of its own, while the next batch stages into spare slots kept for it: the device
keeps writing through a commit's syncs. A borrowed payload (``write_behind``) is written
straight from the caller's buffer when the data file can take it as it is (whole pages,
page-aligned under ``O_DIRECT``), else through a pooled bounce buffer filled here, on the
writer thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np
import xxhash

from kvtier.tiers.buffers import copy_bytes
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk.index import FORMAT_VERSION, MAX_META_BYTES, BlockIndex, Entry
from kvtier.tiers.disk.slots import PAGE, BufferPool, SlotFile, SlotTable
from kvtier.tiers.hashing import check_hash
from kvtier.tiers.ratelog import RateLimitedLog
from kvtier.tiers.tunables import TUNABLES

# Queue operations; the ones below FLUSH change the database.
PUT, TOUCH, DROP, FLUSH, STOP = range(5)

Event = tuple[str, bytes, bytes]
"""(kind, block hash, meta): "stored" or "removed" for subscribers; inside a commit also
"evicted" and "dropped"."""

Staged = tuple[int, int, bytes]
"""(slot, checksum, meta) of a store whose payload is written and whose entry waits."""


STAGED_BATCHES = 2
"""Batches whose payloads may hold slots at once: one committing, the next staging. The
disk tier keeps that many batches of spare slots."""


class Pending:
    """A store not yet committed: its bytes, meta, the callers to tell, the readers copying.

    ``data`` is ``block_bytes`` long: a view of ``buf`` (our pooled copy, from ``put``) or of
    the caller's own buffer (``write_behind``, ``buf`` None).
    """

    __slots__ = ("buf", "callbacks", "data", "meta", "readers")

    def __init__(self, data: memoryview, buf: Any, meta: bytes, on_done: Any) -> None:
        self.data = data
        self.buf = buf
        self.meta = meta
        self.callbacks = [] if on_done is None else [on_done]
        self.readers = 0


def check_block(
    block_hash: bytes, data: Any, meta: bytes, block_bytes: int
) -> tuple[memoryview, bytes]:
    """A store's arguments checked (``ValueError`` if bad): the payload as bytes, the meta."""
    check_hash(block_hash)
    try:
        src = memoryview(data).cast("B")
    except TypeError as exc:
        raise ValueError(f"block must be a C-contiguous buffer: {exc}") from None
    if src.nbytes != block_bytes:
        raise ValueError(f"block must be {block_bytes} bytes, got {src.nbytes}")
    meta = bytes(meta)
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"meta must be at most {MAX_META_BYTES} bytes, got {len(meta)}")
    return src, meta


@dataclass(eq=False, slots=True)
class DiskState:
    """What a disk tier's callers, its writer thread and its commits share.

    ``lock`` guards ``pending``, the counters and the slot pins; ``drained``, a condition on
    it, is notified when the last reader of a pending block is done.
    """

    path: str
    signature: bytes
    block_bytes: int
    index: BlockIndex
    slots: SlotFile
    total_slots: int
    """The data file's slots: the budget and the spares (``recovery.plan``)."""
    table: SlotTable
    pool: BufferPool
    lock: threading.Lock
    drained: threading.Condition
    counters: TierCounters
    failures: RateLimitedLog
    pending: dict[bytes, Pending] = field(default_factory=dict)
    copied_bytes: int = 0
    """Bytes of ``put`` copies in ``pending`` (``DiskTier.put`` bounds them)."""

    def shed(self) -> bool:
        """With ``lock`` held: whether one more ``put`` copy would pass
        ``disk_put_backlog_bytes``; if so it counts and logs the block dropped."""
        if self.copied_bytes + self.block_bytes <= TUNABLES.disk_put_backlog_bytes:
            return False
        self.counters.blocks_dropped += 1
        self.failures.warning(
            "backlog",
            "disk tier %s: %d MiB of copies wait for the device; a block was dropped",
            self.path,
            self.copied_bytes >> 20,
        )
        return True


@dataclass(eq=False, slots=True)
class StagedBatch:
    """One batch's payloads on their way to the device: each store's slot, checksum and meta,
    the writes in flight with the bounce buffers they read, and the first write failure."""

    stores: dict[bytes, Staged] = field(default_factory=dict)
    writes: list[tuple[Future[None], list[Any]]] = field(default_factory=list)
    error: OSError | None = None


class BatchCommitter:
    """Applies batches of queued operations to the index and the data file."""

    def __init__(self, state: DiskState, capacity_blocks: int, sync: bool) -> None:
        self._path = state.path
        self._index = state.index
        self._slots = state.slots
        self._table = state.table
        self._pool = state.pool
        self._lock = state.lock
        self._counters = state.counters
        self._failures = state.failures
        self._signature = state.signature
        self._block_bytes = state.block_bytes
        self._capacity_blocks = capacity_blocks
        self._sync = sync
        self._open = StagedBatch()
        # One thread writes payloads, in the order staged, so the device works while the
        # writer thread checksums and gathers; a batch's commit waits for them before it syncs.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-io")

    def stage(self, stores: dict[bytes, Pending]) -> None:
        """Starts writing the payloads of ``stores`` (pending blocks of PUTs just taken from
        the queue) into free slots; their entries wait for the batch's ``commit``.

        Each store takes a slot of the spares no committed entry names, so a reader never
        meets these bytes before the commit. The writes run on the I/O thread, in order,
        while this thread checksums the same blocks and goes back to the queue. An I/O error
        fails the whole batch at its commit; nothing more of that batch is written.
        """
        batch = self._open
        if batch.error is not None:
            return
        writes: list[tuple[int, memoryview]] = []
        bounces: list[Any] = []
        staged: list[tuple[bytes, Pending]] = []
        try:
            for block_hash, pending in stores.items():
                if block_hash in batch.stores:
                    continue
                view, bounce = self._payload(pending)
                if bounce is not None:
                    bounces.append(bounce)
                slot = self._table.take()
                batch.stores[block_hash] = (slot, 0, pending.meta)
                staged.append((block_hash, pending))
                writes.append((slot, view))
        except OSError as exc:
            batch.error = exc
        if writes or bounces:
            batch.writes.append((self._io.submit(self._slots.write, writes), bounces))
        del writes  # the I/O thread holds the views until its write is done
        for block_hash, pending in staged:
            slot, _, meta = batch.stores[block_hash]
            batch.stores[block_hash] = (slot, xxhash.xxh3_64_intdigest(pending.data), meta)

    def seal(self, stores: dict[bytes, Pending]) -> StagedBatch:
        """Stages what is left of a batch's stores and closes it: what is staged after this
        belongs to the next batch, whose writes may then run while this one commits."""
        self.stage(stores)
        batch, self._open = self._open, StagedBatch()
        return batch

    def close(self) -> None:
        """Waits for the writes in flight and stops the I/O thread (the writer's last act)."""
        self._wait_writes(self._open)
        self._io.shutdown()

    def _wait_writes(self, batch: StagedBatch) -> None:
        """Waits for the batch's payload writes; the first failure fails the batch."""
        for write, bounces in batch.writes:
            try:
                write.result()
            except OSError as exc:
                batch.error = batch.error or exc
            finally:
                for buf in bounces:
                    self._pool.release(buf)
        batch.writes.clear()

    def commit(self, ops: list[tuple[int, Any]], batch: StagedBatch) -> tuple[list[Event], bool]:
        """Writes ``ops`` in one transaction; returns the events to report and whether the
        stores that ``batch`` staged (``seal``: all of the ops' stores) were committed. Call
        from one thread only (LMDB's rule for write transactions).

        A full map (a reader pinning an old snapshot keeps freed pages from reuse) is answered
        by evicting the oldest blocks in a commit of their own and trying again. LMDB reuses
        the pages a commit frees only once another commit has followed it, so with nothing
        left to evict one marker commit goes first. If even that finds no room, the batch is
        given up (its stores fail, logged), never raised. I/O errors are raised.
        """
        self._wait_writes(batch)
        staged = batch.stores
        taken: list[int] = []
        try:
            if batch.error is not None:
                raise batch.error
            events, ok = self._commit_staged(ops, staged, taken)
        except BaseException:
            self._table.free(slot for slot, _, _ in staged.values())
            raise
        # Slots staged for stores the commit skipped (held already) or gave up are free again.
        kept = set(taken) if ok else set()
        self._table.free(slot for slot, _, _ in staged.values() if slot not in kept)
        return events, ok

    def _payload(self, pending: Pending) -> tuple[memoryview, Any]:
        """The page-aligned bytes to write for a store, and the bounce buffer they are in
        (None when no copy was needed)."""
        if pending.buf is not None:
            return memoryview(pending.buf), None
        if self._writable_as_is(pending.data):
            return pending.data, None
        bounce = self._pool.acquire()
        view = memoryview(bounce)
        copy_bytes(view[: self._block_bytes], pending.data)
        return view, bounce

    def _writable_as_is(self, data: memoryview) -> bool:
        """Whether the data file can take ``data`` with no copy: whole pages, and page-aligned
        where the file is written with ``O_DIRECT``."""
        if self._block_bytes % PAGE:
            return False
        return not self._slots.direct or np.frombuffer(data, np.uint8).ctypes.data % PAGE == 0

    def _commit_staged(
        self, ops: list[tuple[int, Any]], staged: dict[bytes, Staged], taken: list[int]
    ) -> tuple[list[Event], bool]:
        events: list[Event] = []
        marked = False
        while True:
            taken.clear()
            try:
                with self._index.write() as txn:
                    changes, freed = self._apply(txn, ops, staged, taken)
                    if taken and self._sync:
                        self._slots.sync()
            except lmdb.MapFullError:
                puts = sum(op == PUT for op, _ in ops)
            else:
                # Only now, with their deletions committed, may a later batch reuse these.
                self._table.free(freed)
                return events + self._publish(changes), True
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
                self._table.free([entry.slot for _, entry in evicted])
                events += self._publish([("evicted", h, e.meta) for h, e in evicted])
                continue
            self._failures.warning(
                "map-full", "disk tier %s: index map full, %d blocks not stored", self._path, puts
            )
            return events, False

    def _apply(
        self,
        txn: lmdb.Transaction,
        ops: list[tuple[int, Any]],
        staged: dict[bytes, Staged],
        taken: list[int],
    ) -> tuple[list[Event], list[int]]:
        """Applies stores (their payloads already staged), access bumps and drops to the
        index, in order.

        Returns what changed (in order) and the slots the commit frees; the staged slots that
        entries now name go into ``taken``.
        """
        changes: list[Event] = []
        freed: list[int] = []
        used = self._counters.used_blocks  # only this thread changes it
        for op, arg in ops:
            block_hash = arg[0] if op == DROP else arg
            entry = self._index.get(txn, block_hash)
            if op == PUT:
                if entry is not None or block_hash not in staged:
                    continue
                for victim, old in self._index.evict(txn, used + 1 - self._capacity_blocks):
                    changes.append(("evicted", victim, old.meta))
                    freed.append(old.slot)
                    used -= 1
                slot, checksum, meta = staged[block_hash]
                taken.append(slot)
                new = Entry(
                    FORMAT_VERSION, 0, slot, self._signature, self._block_bytes, checksum, meta
                )
                self._index.insert(txn, block_hash, new)
                changes.append(("stored", block_hash, meta))
                used += 1
            elif entry is None:
                continue
            elif op == TOUCH:
                self._index.touch(txn, block_hash, entry)
            elif entry.slot == arg[1]:  # not a copy stored again since the bad read
                self._index.delete(txn, block_hash, entry)
                if entry.slot >= 0:
                    freed.append(entry.slot)
                changes.append(("dropped", block_hash, entry.meta))
                used -= 1
        return changes, freed

    def _publish(self, changes: list[Event]) -> list[Event]:
        """After a commit: counts the changes and returns them as public events."""
        c = self._counters
        with self._lock:
            for kind, _, _ in changes:
                if kind == "stored":
                    c.blocks_stored += 1
                    c.bytes_in += self._block_bytes
                    c.used_blocks += 1
                else:
                    c.blocks_evicted += kind == "evicted"
                    c.used_blocks -= 1
            c.used_bytes = c.used_blocks * self._block_bytes
        return [("stored" if k == "stored" else "removed", h, m) for k, h, m in changes]
