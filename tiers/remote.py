"""The remote tier: blocks in a store shared by many nodes, below each node's disk tier.

What the daemon calls (every call is batched and bounded in time):

* ``lookup_prefix(hashes)``: how many leading blocks the store holds (one ``EXISTS`` round trip
  per endpoint, all endpoints at once);
* ``get_into(hashes, outs)``: fetches the leading blocks into the caller's buffers, each checked
  against its header and checksum (``remote_format``), stopping at the first block it cannot
  deliver;
* ``write_behind(hash, data, meta, on_done)``: the disk tier's borrow contract. The block joins
  a bounded queue (a full one drops it at once, counted) and a writer thread stores it in
  batches, skipping blocks the store already holds.

The store is a ``RemoteBackend``; capacity and eviction are its own. Nothing here waits longer
than its timeout or raises for the store's faults: an endpoint that is down, slow or failing
over gives counted misses (``fault_misses``), and after a few failed calls its circuit breaker
cuts it off until a probe finds it answering again (``remote_routes``).

A call that times out returns while its worker may still be talking to the store; the borrowed
buffers are guarded (``_Borrow``) so that no copy into an ``out`` or from a ``data`` starts
after the call has answered for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import check_hash
from kvtier.tiers.remote_backend import RemoteBackend, RemoteError
from kvtier.tiers.remote_format import (
    MAX_META_BYTES,
    block_key,
    check_prefix,
    pack_into,
    unpack,
    value_size,
)
from kvtier.tiers.remote_routes import Routes

log = logging.getLogger(__name__)

OnDone = Callable[[bool], None]


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """How the tier uses its store; the defaults suit 2 MiB blocks on a data-centre network."""

    lookup_timeout_s: float = 0.5
    """Longest wait for a lookup's answer (it is on the engine's scheduling path)."""
    transfer_timeout_s: float = 5.0
    """Longest wait for a get or a batch of writes."""
    connections: int = 4
    """Calls in flight per store endpoint (each on its own connection)."""
    pipeline_blocks: int = 4
    """Blocks per pipelined call; a batch is split into such calls that run in parallel."""
    batch_blocks: int = 16
    """Queued writes the writer takes at once."""
    queue_bytes: int = 256 << 20
    """Payload bytes of writes waiting in the queue before new ones are dropped."""
    failures_to_open: int = 3
    probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("lookup_timeout_s", "transfer_timeout_s", "probe_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("connections", "pipeline_blocks", "batch_blocks", "failures_to_open"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.queue_bytes < 0:
            raise ValueError("queue_bytes must be >= 0")


class _Borrow:
    """Copies that a call makes from or into its caller's buffers, stopped when it answers.

    A worker copies only between ``begin()`` (False once the call has answered) and ``end()``;
    ``close()`` forbids new copies and waits for those under way, one block each at most.
    """

    __slots__ = ("_active", "_closed", "_cond")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._closed = False

    def begin(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def end(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._active)


@dataclass(slots=True)
class _Write:
    block_hash: bytes
    key: bytes
    data: memoryview
    meta: bytes
    on_done: OnDone | None


class _BufferPool:
    """Value buffers for the writer: a fresh 2 MiB allocation costs page faults on each use."""

    def __init__(self, size: int, keep: int) -> None:
        self._size = size
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self._size)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


class RemoteTier:
    """Blocks of ``block_bytes`` of one layout in ``backend``, under the key ``prefix``.

    ``prefix`` is the namespace the daemon builds (``remote_format.key_prefix``).
    ``on_event("stored", hash, meta)`` hears each block this tier wrote, from the writer's side,
    outside any lock; it must not block or call back into the tier.
    """

    def __init__(
        self,
        backend: RemoteBackend,
        layout_signature: bytes,
        block_bytes: int,
        prefix: str,
        settings: RemoteSettings | None = None,
        *,
        counters: TierCounters | None = None,
        on_event: Callable[[str, bytes, bytes], None] | None = None,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.settings = settings = settings or RemoteSettings()
        self.block_bytes = block_bytes
        self.counters = counters if counters is not None else TierCounters("remote")
        self._backend = backend
        self._signature = bytes(layout_signature)
        self._prefix = check_prefix(prefix)
        self._on_event = on_event
        self._lock = threading.Lock()
        self._routes = Routes(
            backend,
            self.counters,
            self._lock,
            threads=settings.connections,
            failures_to_open=settings.failures_to_open,
            probe_interval_s=settings.probe_interval_s,
        )
        self._buffers = _BufferPool(
            value_size(block_bytes, MAX_META_BYTES), 2 * settings.batch_blocks
        )
        self._max_queued = max(1, settings.queue_bytes // block_bytes)
        self._queue: deque[_Write] = deque()
        self._queued: set[bytes] = set()  # hashes queued or being written
        self._changed = threading.Condition(self._lock)
        self._writing = 0
        self._closed = False
        self._drain_until = float("inf")
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-remote-writer")
        self._writer.daemon = True
        self._writer.start()

    # ---- reads (any thread) ----

    def lookup_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the store holds; a fault ends the prefix (counted)."""
        keys = self._keys(hashes)
        found = [False] * len(keys)

        def work(route: str, indices: list[int]) -> None:
            for i, held in zip(
                indices, self._backend.exists(route, [keys[i] for i in indices]), strict=True
            ):
                found[i] = held

        self._count_faults(self._fan_out(keys, work, self.settings.lookup_timeout_s, len(keys)))
        return found.index(False) if False in found else len(found)

    def get_into(self, hashes: Sequence[bytes], outs: Sequence[Any]) -> list[bytes]:
        """Fetches the leading blocks of ``hashes`` into ``outs`` (writable buffers of
        ``block_bytes``); returns the meta of each block fetched, in order.

        Stops at the first block that is absent, corrupt (counted in ``checksum_failures`` and
        deleted from the store) or lost to a fault (counted in ``fault_misses``); the ``outs``
        beyond the result hold no meaningful bytes. Raises only for bad arguments.
        """
        if len(outs) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(outs)} buffers")
        dsts = [memoryview(out).cast("B") for out in outs]
        for dst in dsts:
            if dst.readonly or dst.nbytes != self.block_bytes:
                raise ValueError(f"each out must be a writable buffer of {self.block_bytes} B")
        keys = self._keys(hashes)
        metas: list[bytes | None] = [None] * len(keys)
        corrupt: list[int] = []
        borrow = _Borrow()

        def work(route: str, indices: list[int]) -> None:
            values = self._backend.get(route, [keys[i] for i in indices])
            for i, value in zip(indices, values, strict=True):
                if value is None:
                    continue
                try:
                    meta, offset = unpack(value, self._signature, hashes[i], self.block_bytes)
                except ValueError as exc:
                    log.warning("%s: block %s is corrupt: %s", route, hashes[i].hex(), exc)
                    corrupt.append(i)
                    continue
                if not borrow.begin():
                    return
                try:
                    dsts[i][:] = memoryview(value)[offset : offset + self.block_bytes]
                finally:
                    borrow.end()
                metas[i] = meta

        missed = self._fan_out(
            keys, work, self.settings.transfer_timeout_s, self.settings.pipeline_blocks
        )
        borrow.close()
        fetched = metas.index(None) if None in metas else len(metas)
        with self._lock:
            self.counters.fault_misses += missed
            self.counters.blocks_loaded += fetched
            self.counters.bytes_out += fetched * self.block_bytes
            self.counters.checksum_failures += len(corrupt)
        if corrupt:
            self._forget([keys[i] for i in corrupt])
        return metas[:fetched]

    # ---- writes (any thread) ----

    def write_behind(
        self, block_hash: bytes, data: Any, meta: bytes = b"", on_done: OnDone | None = None
    ) -> None:
        """Queues the block for the store, borrowing ``data`` until ``on_done`` is called.

        ``on_done(True)`` once the store holds the block (or at once if it is already queued),
        ``on_done(False)`` if it was not stored: dropped at once when the queue is full, the
        block's endpoint is cut off or the tier is closed, later if the write failed. Every
        block gets exactly one call, never under the tier's lock.
        """
        check_hash(block_hash)
        src = memoryview(data).cast("B")
        if src.nbytes != self.block_bytes:
            raise ValueError(f"block must be {self.block_bytes} B, got {src.nbytes}")
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"meta is {len(meta)} B, at most {MAX_META_BYTES}")
        key = block_key(self._prefix, block_hash)
        _, cut = self._routes.group([key])
        with self._lock:
            if block_hash in self._queued:
                self.counters.blocks_deduplicated += 1
                verdict = True
            elif self._closed or cut or len(self._queue) >= self._max_queued:
                self.counters.blocks_dropped += 1
                verdict = False
            else:
                self._queue.append(_Write(block_hash, key, src, bytes(meta), on_done))
                self._queued.add(block_hash)
                self._changed.notify_all()
                return
        if on_done is not None:
            on_done(verdict)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every write queued before it has been stored or dropped.

        Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: not self._queue and not self._writing, timeout):
                raise TimeoutError(f"remote tier: writes still queued after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Stores what is queued for up to ``timeout`` seconds (default: the transfer timeout),
        drops the rest, and closes the store's connections (idempotent)."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            wait_s = self.settings.transfer_timeout_s if timeout is None else timeout
            self._drain_until = time.monotonic() + wait_s
            self._changed.notify_all()
        self._writer.join()
        self._routes.close()
        self._backend.close()

    def open_routes(self) -> list[str]:
        """The store endpoints whose breaker is open now."""
        return self._routes.open_routes()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    def _keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        return [block_key(self._prefix, h) for h in hashes]

    def _fan_out(
        self,
        keys: Sequence[bytes],
        work: Callable[[str, list[int]], None],
        timeout: float,
        chunk: int,
    ) -> int:
        """Runs ``work(route, indices)`` on the route of each key, ``chunk`` keys a call, all at
        once, waiting at most ``timeout``; each route's breaker hears how it did. Returns how
        many keys went unanswered: their call failed or did not finish, or their route is cut
        off."""
        if not keys:
            return 0
        groups, cut = self._routes.group(keys)
        calls = {}
        for route, indices in groups.items():
            for start in range(0, len(indices), chunk):
                part = indices[start : start + chunk]
                calls[self._routes.submit(route, work, route, part)] = (route, len(part))
        done, late = wait(calls, timeout)
        failed: dict[str, BaseException] = {}
        missed = len(cut)
        for future in late:
            future.cancel()
            route, count = calls[future]
            failed.setdefault(route, TimeoutError(f"no answer in {timeout} s"))
            missed += count
        for future in done:
            error = future.exception()
            if error is None:
                continue
            route, count = calls[future]
            if not isinstance(error, RemoteError):
                # A bug, not the store: logged in full, but it must not fail the engine's call.
                log.error("remote tier call on %s failed", route, exc_info=error)
            failed.setdefault(route, error)
            missed += count
        for route in groups:
            if route in failed:
                self._routes.failed(route, failed[route])
            else:
                self._routes.succeeded(route)
        return missed

    def _count_faults(self, missed: int) -> None:
        if missed:
            with self._lock:
                self.counters.fault_misses += missed

    def _forget(self, keys: list[bytes]) -> None:
        """Deletes corrupt values in the background, so a good copy can be written again."""
        groups, _ = self._routes.group(keys)
        for route, indices in groups.items():
            self._routes.submit(route, self._delete, route, [keys[i] for i in indices])

    def _delete(self, route: str, keys: list[bytes]) -> None:
        try:
            self._backend.delete(route, keys)
        except RemoteError as exc:
            log.warning("%s: could not delete %d corrupt blocks: %s", route, len(keys), exc)

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                take = min(len(self._queue), self.settings.batch_blocks)
                batch = [self._queue.popleft() for _ in range(take)]
                self._writing = len(batch)
                drain = not self._closed or time.monotonic() < self._drain_until
            stored = self._write(batch) if drain else self._drop(batch)
            with self._changed:
                for write in batch:
                    self._queued.discard(write.block_hash)
                self._writing = 0
                self._changed.notify_all()
            for write, ok in zip(batch, stored, strict=True):
                if ok and self._on_event is not None:
                    self._on_event("stored", write.block_hash, write.meta)
                if write.on_done is not None:
                    write.on_done(ok)

    def _drop(self, batch: list[_Write]) -> list[bool]:
        with self._lock:
            self.counters.blocks_dropped += len(batch)
        return [False] * len(batch)

    def _write(self, batch: list[_Write]) -> list[bool]:
        """Stores one batch, skipping blocks the store holds; True for each block it holds."""
        keys = [w.key for w in batch]
        outcome: list[bool | None] = [None] * len(batch)  # True stored, False already held
        borrow = _Borrow()

        def work(route: str, indices: list[int]) -> None:
            held = self._backend.exists(route, [keys[i] for i in indices])
            todo = []
            for i, present in zip(indices, held, strict=True):
                if present:
                    outcome[i] = False
                else:
                    todo.append(i)
            if not todo:
                return
            buffers = [self._buffers.take() for _ in todo]
            try:
                items = []
                for i, buf in zip(todo, buffers, strict=True):
                    w = batch[i]
                    if not borrow.begin():
                        return
                    try:
                        value = pack_into(buf, self._signature, w.block_hash, w.meta, w.data)
                    finally:
                        borrow.end()
                    items.append((keys[i], value))
                for i, ok in zip(todo, self._backend.put(route, items), strict=True):
                    outcome[i] = True if ok else None
            finally:
                for buf in buffers:
                    self._buffers.give(buf)

        self._fan_out(keys, work, self.settings.transfer_timeout_s, self.settings.pipeline_blocks)
        borrow.close()
        size = self.block_bytes
        with self._lock:
            c = self.counters
            for result in outcome:
                if result is True:
                    c.blocks_stored += 1
                    c.bytes_in += size
                elif result is False:
                    c.blocks_deduplicated += 1
                else:
                    c.blocks_dropped += 1
        return [result is not None for result in outcome]
