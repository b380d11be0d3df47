"""The remote tier's write-behind half: a bounded queue of borrowed blocks and the thread that
stores them in batches.

A block joins the queue at once or is dropped at once (queue full, its endpoint cut off, the
tier closed), counted, so the caller never waits. The writer takes up to ``batch_blocks``,
asks the store which it already holds (one ``EXISTS`` round trip per endpoint: those are not
sent again) and sends the others pipelined, every endpoint at once, each value as its header
and the caller's own buffer: the payload is never copied on this side of the socket. A send
holds a ``Borrow`` of the callers' buffers, so ``on_done`` comes only once no call reads them,
even when a call outlives its timeout (it then ends on the socket timeout).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import check_hash
from kvtier.tiers.remote.backend import RemoteBackend
from kvtier.tiers.remote.format import MAX_META_BYTES, block_key, head
from kvtier.tiers.remote.routes import Borrow, Routes

OnDone = Callable[[bool], None]


@dataclass(slots=True)
class _Write:
    block_hash: bytes
    key: bytes
    data: memoryview
    meta: bytes
    on_done: OnDone | None


class RemoteWriter:
    """Write-behind of blocks of ``block_bytes`` into ``backend``, counted in ``counters`` under
    ``lock`` (the tier's)."""

    def __init__(
        self,
        backend: RemoteBackend,
        routes: Routes,
        counters: TierCounters,
        lock: threading.Lock,
        signature: bytes,
        block_bytes: int,
        prefix: bytes,
        *,
        max_queued: int,
        batch_blocks: int,
        pipeline_blocks: int,
        transfer_timeout_s: float,
        on_event: Callable[[str, bytes, bytes], None] | None,
    ) -> None:
        self.block_bytes = block_bytes
        self.counters = counters
        self._backend = backend
        self._routes = routes
        self._lock = lock
        self._signature = signature
        self._prefix = prefix
        self._max_queued = max_queued
        self._batch_blocks = batch_blocks
        self._pipeline_blocks = pipeline_blocks
        self._timeout_s = transfer_timeout_s
        self._on_event = on_event
        self._queue: deque[_Write] = deque()
        self._queued: set[bytes] = set()  # hashes queued or being written
        self._changed = threading.Condition(lock)
        self._writing = 0
        self._closed = False
        self._drain_until = float("inf")
        self._thread = threading.Thread(target=self._write_loop, name="kvtier-remote-writer")
        self._thread.daemon = True
        self._thread.start()

    def write_behind(
        self, block_hash: bytes, data: Any, meta: bytes = b"", on_done: OnDone | None = None
    ) -> None:
        """``RemoteTier.write_behind``."""
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

    def close(self, timeout: float) -> None:
        """Stores what is queued for up to ``timeout`` seconds, drops the rest (idempotent)."""
        with self._changed:
            if not self._closed:
                self._closed = True
                self._drain_until = time.monotonic() + timeout
                self._changed.notify_all()
        self._thread.join()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                take = min(len(self._queue), self._batch_blocks)
                batch = [self._queue.popleft() for _ in range(take)]
                self._writing = len(batch)
                drain = not self._closed or time.monotonic() < self._drain_until
            stored = self._write(batch) if drain else self._drop(batch)
            for write, ok in zip(batch, stored, strict=True):
                if ok and self._on_event is not None:
                    self._on_event("stored", write.block_hash, write.meta)
                if write.on_done is not None:
                    write.on_done(ok)
            with self._changed:  # only now: a flush returns after the callbacks
                for write in batch:
                    self._queued.discard(write.block_hash)
                self._writing = 0
                self._changed.notify_all()

    def _drop(self, batch: list[_Write]) -> list[bool]:
        with self._lock:
            self.counters.blocks_dropped += len(batch)
        return [False] * len(batch)

    def _write(self, batch: list[_Write]) -> list[bool]:
        """Stores one batch, skipping blocks the store holds; True for each block it holds."""
        keys = [w.key for w in batch]
        outcome: list[bool | None] = [None] * len(batch)  # True stored, False already held
        borrow = Borrow()

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
            # The sends read the callers' buffers: they stay borrowed until the call returns.
            if not borrow.begin():
                return
            try:
                items = []
                for i in todo:
                    w = batch[i]
                    items.append(
                        (keys[i], (head(self._signature, w.block_hash, w.meta, w.data), w.data))
                    )
                for i, ok in zip(todo, self._backend.put(route, items), strict=True):
                    outcome[i] = True if ok else None
            finally:
                borrow.end()

        self._routes.fan_out(keys, work, self._timeout_s, self._pipeline_blocks)
        borrow.close()
        outcome = list(outcome)  # a call that timed out may still answer: too late to count
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
