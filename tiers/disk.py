"""The disk tier: blocks in an LMDB environment on local NVMe, under a byte budget with LRU.

Three named databases live in one environment and change together in the same transactions:
``blocks`` maps a 16-byte block hash to a header (magic, format version, layout signature,
payload length, xxh3_64 of the payload) followed by the block's bytes; ``index`` maps the hash
to its access sequence number and layout signature; ``order`` maps the big-endian sequence
number back to the hash, so its first key is the least recently used block. Reopening a
directory therefore recovers every committed block and its recency.

One writer thread owns every write transaction: ``put`` copies the block, parks it in a pending
map (readable at once) and queues it; the writer drains its queue greedily into one transaction,
evicting the least recently used blocks first when the budget is spent. Readers use short
``buffers=True`` transactions, copy the bytes out before they end and queue their access-order
bumps to the writer. A value whose header or checksum does not match is a miss, counted and
dropped, never data.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import xxhash

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import HASH_BYTES

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"KVTB"
# magic, format version, header size, layout signature, payload length, xxh3_64 of the payload
_HEADER = struct.Struct("<4sHH16sQQ")
# index value: access sequence number, layout signature
_INDEX = struct.Struct(">Q16s")
# order key: big-endian, so LMDB's byte order is access order
_SEQ = struct.Struct(">Q")
_SIGNATURE_BYTES = 16
# A key of the main database, written only to make a commit (see DiskTier._commit).
_MARKER = b"kvtier-marker"
# One write transaction takes at most this many bytes of new blocks (and no more blocks than
# the budget), which bounds the map room a batch needs while its evicted pages wait for reuse.
_MAX_BATCH_BYTES = 256 << 20
_PAGE = 4096
# Map bytes beyond the blocks, for meta, B-tree and free-list pages.
_MAP_SLACK = 1 << 20

# Writer queue operations; the ones below _FLUSH change the database.
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


class DiskTier:
    """Blocks of ``block_bytes`` bytes in the LMDB environment at ``path``, LRU within a budget.

    ``capacity_bytes`` bounds the payload bytes kept (whole blocks); the memory map is sized
    from it, twice over (``_plan_map``). ``on_event(kind, hash)`` is called from the writer
    thread, outside any lock, with ``"stored"`` after a block is committed and ``"removed"``
    after one is evicted or dropped (blocks found or dropped at start-up are not announced).
    ``sync=False`` skips the fsync at each commit: committed blocks then survive a crash of the
    process, not one of the machine. A ``map_size`` too small for the budget lowers the budget.
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
        self._capacity_blocks, self._batch_blocks, map_size = _plan_map(
            block_bytes, capacity_bytes, map_size
        )
        self.block_bytes = block_bytes
        self.counters = counters if counters is not None else TierCounters(tier="disk")
        self._signature = bytes(layout_signature)
        # every header field but the checksum, as ``_HEADER.unpack`` returns them
        self._header_fields = (_MAGIC, FORMAT_VERSION, _HEADER.size, self._signature, block_bytes)
        self._on_event = on_event
        self._sync = sync
        self._lock = threading.Lock()
        self._pending: dict[bytes, bytearray] = {}
        self._queue: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._closed = False
        self._writer_alive = True

        self._path = os.path.realpath(path)
        with _open_paths_lock:
            if self._path in _open_paths:
                raise RuntimeError(
                    f"disk tier {self._path} is already open in this process; "
                    "close it before opening it again"
                )
            _open_paths.add(self._path)
        try:
            # No writemap: writing through the map would read every reused page from disk
            # before overwriting it (the tier is larger than RAM, so they are rarely cached)
            # and would turn a full disk into SIGBUS instead of an error.
            self._env = lmdb.open(
                self._path,
                map_size=map_size,
                max_dbs=3,
                max_readers=512,
                sync=sync,
                metasync=sync,
            )
            self._env.reader_check()
            self._blocks = self._env.open_db(b"blocks")
            self._index = self._env.open_db(b"index")
            self._order = self._env.open_db(b"order")
            self._recover()
        except BaseException:
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
            _check_hash(h)
        # Pending first, LMDB second: the writer commits before it forgets a pending block,
        # so a block leaving the pending map is already visible to a transaction begun later.
        with self._lock:
            pending = [h in self._pending for h in hashes]
        with self._env.begin(db=self._index, buffers=True) as txn:
            for n, (h, is_pending) in enumerate(zip(hashes, pending, strict=True)):
                if not is_pending and txn.get(h) is None:
                    return n
        return len(hashes)

    def get_into(self, block_hash: bytes, out: Any) -> bool:
        """Copies the block into ``out`` (a writable buffer of ``block_bytes``); False on a miss.

        A stored value whose header or checksum does not match is a miss: it is counted in
        ``checksum_failures`` and dropped, and ``out`` then holds no meaningful bytes.
        """
        _check_hash(block_hash)
        dst = memoryview(out).cast("B")
        if dst.readonly or dst.nbytes != self.block_bytes:
            raise ValueError(f"out must be a writable buffer of {self.block_bytes} bytes")
        with self._lock:
            value = self._pending.get(block_hash)
        if value is not None:
            # Pending values are never mutated, so the copy needs no lock.
            dst[:] = memoryview(value)[_HEADER.size :]
            self._count_load()
            return True
        with self._env.begin(db=self._blocks, buffers=True) as txn:
            stored = txn.get(block_hash)
            if stored is None:
                return False
            header = self._header(stored)
            if header is not None:
                dst[:] = stored[_HEADER.size :]
        # The checksum runs on our own copy, after the transaction has let go of the map.
        if header is not None and xxhash.xxh3_64_intdigest(dst) == header[5]:
            self._count_load()
            self._enqueue(_TOUCH, block_hash)
            return True
        log.warning("disk tier %s: corrupt block %s dropped", self._path, block_hash.hex())
        with self._lock:
            self.counters.checksum_failures += 1
        self._enqueue(_DROP, block_hash)
        return False

    # ---- writers (any thread) ----

    def put(self, block_hash: bytes, data: Any) -> None:
        """Stores a copy of ``data`` (a C-contiguous buffer of ``block_bytes``) under the hash.

        The bytes are copied before this returns and are readable at once; the writer thread
        commits them later (``flush`` waits for that). A block already held is left as it is.
        """
        _check_hash(block_hash)
        src = memoryview(data).cast("B")
        if src.nbytes != self.block_bytes:
            raise ValueError(f"block must be {self.block_bytes} bytes, got {src.nbytes}")
        with self._lock:
            self._check_open()
        if self.contains(block_hash):
            return
        # Our one copy of the payload goes straight behind the header, so that LMDB gets the
        # whole value as one buffer in one put.
        value = bytearray(_HEADER.size + self.block_bytes)
        payload = memoryview(value)[_HEADER.size :]
        payload[:] = src
        _HEADER.pack_into(value, 0, *self._header_fields, xxhash.xxh3_64_intdigest(payload))
        with self._lock:
            self._check_open()
            if block_hash not in self._pending:
                self._pending[block_hash] = value
                self._queue.put((_PUT, block_hash))

    def flush(self, timeout: float | None = None) -> None:
        """Blocks until everything queued before this call is committed to LMDB.

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
        """Commits everything queued, stops the writer and closes the environment (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._writer_alive:
                self._queue.put((_STOP, None))
        self._writer.join()
        if not self._sync:
            self._env.sync(True)
        self._env.close()
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

    def _enqueue(self, op: int, block_hash: bytes) -> None:
        with self._lock:
            if not self._closed and self._writer_alive:
                self._queue.put((op, block_hash))

    def _count_load(self) -> None:
        with self._lock:
            self.counters.blocks_loaded += 1
            self.counters.bytes_out += self.block_bytes

    def _header(self, value: memoryview) -> tuple[Any, ...] | None:
        """The value's header fields if they match this tier's, else None."""
        if len(value) != _HEADER.size + self.block_bytes:
            return None
        header = _HEADER.unpack_from(value)
        return header if header[:5] == self._header_fields else None

    # ---- start-up ----

    def _recover(self) -> None:
        """Counts committed blocks, drops other layouts' blocks and evicts down to the budget."""
        with self._env.begin(write=True) as txn:
            foreign = []
            used = 0
            for block_hash, entry in txn.cursor(db=self._index):
                seq, signature = _INDEX.unpack(entry)
                if signature == self._signature:
                    used += 1
                else:
                    foreign.append((block_hash, seq))
            for block_hash, seq in foreign:
                self._delete(txn, block_hash, seq)
            evicted = len(self._evict(txn, used - self._capacity_blocks))
            cursor = txn.cursor(db=self._order)
            self._next_seq = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
        if foreign:
            log.warning(
                "disk tier %s: dropped %d blocks stored for another layout",
                self._path,
                len(foreign),
            )
        c = self.counters
        c.blocks_evicted += len(foreign) + evicted
        c.used_blocks = used - evicted
        c.used_bytes = c.used_blocks * self.block_bytes

    # ---- the writer thread ----

    def _run(self) -> None:
        batch: list[tuple[int, Any]] = []
        try:
            stop = False
            while not stop:
                batch = self._next_batch()
                stop = any(op == _STOP for op, _ in batch)
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
        """Blocks for one operation, then takes whatever else is queued, up to a byte bound."""
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
        """Commits one batch, tells ``on_event``, then releases the batch's flush markers."""
        error: BaseException | None = None
        events: list[tuple[str, bytes]] = []
        try:
            events = self._commit([item for item in batch if item[0] < _FLUSH])
        except Exception as exc:  # one failed batch (an I/O error) must not stop the writer
            log.exception("disk tier %s: write of %d operations failed", self._path, len(batch))
            error = exc
            with self._lock:
                for op, block_hash in batch:
                    if op == _PUT:
                        self._pending.pop(block_hash, None)
        if self._on_event is not None:
            for kind, block_hash in events:
                try:
                    self._on_event(kind, block_hash)
                except Exception:  # a subscriber's bug must not stop the disk tier
                    log.exception("disk tier %s: on_event(%r) failed", self._path, kind)
        for op, marker in batch:
            if op == _FLUSH:
                marker.finish(error)

    def _commit(self, ops: list[tuple[int, Any]]) -> list[tuple[str, bytes]]:
        """Writes ``ops`` in one transaction and returns the events to report.

        A full map (a reader pinning an old snapshot keeps freed pages from reuse) is answered
        by evicting the oldest blocks in a commit of their own and trying again. LMDB reuses
        the pages a commit frees only once another commit has followed it, so with nothing left
        to evict one marker commit goes first. If even that finds no room, the batch is given
        up with an error in the log (its blocks are not stored), never raised to a caller.
        """
        events: list[tuple[str, bytes]] = []
        marked = False
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    changes = self._apply(txn, ops)
                return events + self._publish(changes, ops)
            except lmdb.MapFullError:
                puts = sum(op == _PUT for op, _ in ops)
            try:
                with self._env.begin(write=True) as txn:
                    evicted = self._evict(txn, max(puts, 1))
                    mark = not evicted and not marked
                    if mark:
                        txn.put(_MARKER, b"")
            except lmdb.MapFullError:
                evicted, mark = [], False
            if evicted or mark:
                marked = marked or mark
                events += self._publish([("evicted", h) for h in evicted], [])
                continue
            log.error("disk tier %s: map full, %d blocks not stored", self._path, puts)
            with self._lock:
                for op, block_hash in ops:
                    if op == _PUT:
                        self._pending.pop(block_hash, None)
            return events

    def _apply(self, txn: lmdb.Transaction, ops: list[tuple[int, Any]]) -> list[tuple[str, bytes]]:
        """Applies puts, access bumps and drops in order; returns what changed, in order."""
        changes: list[tuple[str, bytes]] = []
        used = self.counters.used_blocks  # only this thread changes it
        for op, block_hash in ops:
            entry = txn.get(block_hash, db=self._index)
            if op == _PUT:
                if entry is not None:
                    continue
                for evicted in self._evict(txn, used + 1 - self._capacity_blocks):
                    changes.append(("evicted", evicted))
                    used -= 1
                with self._lock:
                    value = self._pending[block_hash]
                txn.put(block_hash, value, db=self._blocks)
                self._insert_order(txn, block_hash)
                changes.append(("stored", block_hash))
                used += 1
            elif entry is not None:
                seq = _INDEX.unpack(entry)[0]
                if op == _TOUCH:
                    txn.delete(_SEQ.pack(seq), db=self._order)
                    self._insert_order(txn, block_hash)
                else:
                    self._delete(txn, block_hash, seq)
                    changes.append(("dropped", block_hash))
                    used -= 1
        return changes

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
            for op, block_hash in ops:
                if op == _PUT:
                    self._pending.pop(block_hash, None)
        return [("stored" if kind == "stored" else "removed", h) for kind, h in changes]

    def _insert_order(self, txn: lmdb.Transaction, block_hash: bytes) -> None:
        """Makes the block the most recently used one."""
        seq = self._next_seq
        self._next_seq += 1  # a gap left by an aborted transaction is harmless
        txn.put(block_hash, _INDEX.pack(seq, self._signature), db=self._index)
        txn.put(_SEQ.pack(seq), block_hash, db=self._order)

    def _delete(self, txn: lmdb.Transaction, block_hash: bytes, seq: int) -> None:
        txn.delete(block_hash, db=self._blocks)
        txn.delete(block_hash, db=self._index)
        txn.delete(_SEQ.pack(seq), db=self._order)

    def _evict(self, txn: lmdb.Transaction, count: int) -> list[bytes]:
        """Deletes up to ``count`` least recently used blocks; returns their hashes."""
        victims: list[tuple[int, bytes]] = []
        if count > 0:
            cursor = txn.cursor(db=self._order)
            for key, block_hash in cursor:
                victims.append((_SEQ.unpack(key)[0], block_hash))
                if len(victims) == count:
                    break
        for seq, block_hash in victims:
            self._delete(txn, block_hash, seq)
        return [block_hash for _, block_hash in victims]


def _plan_map(block_bytes: int, capacity_bytes: int, map_size: int | None) -> tuple[int, int, int]:
    """Returns (budget in blocks, most blocks per write transaction, map size in bytes).

    The map is address space only (the file grows as used) and holds twice the budget and two
    batches, because LMDB reuses a freed page only two commits later and runs of free pages
    fragment; the budget never fills it, so a full map stays rare. A given ``map_size`` keeps
    those proportions by lowering the budget.
    """
    value_bytes = -(-(16 + _HEADER.size + block_bytes) // _PAGE) * _PAGE  # whole pages
    batch_max = max(1, _MAX_BATCH_BYTES // block_bytes)
    capacity = capacity_bytes // block_bytes
    if map_size is not None:
        room = (map_size - _MAP_SLACK) // (2 * value_bytes)  # = budget + two batches
        capacity = min(capacity, max(room // 3, room - 2 * batch_max))
    if capacity < 1:
        raise ValueError(
            f"capacity {capacity_bytes} B or map size {map_size} B holds no block of "
            f"{block_bytes} B"
        )
    batch = min(batch_max, capacity)
    if map_size is None:
        map_size = 2 * (capacity + 2 * batch) * value_bytes + _MAP_SLACK
    return capacity, batch, map_size


def _check_hash(block_hash: bytes) -> None:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"block hash must be {HASH_BYTES} bytes, got {len(block_hash)}")
