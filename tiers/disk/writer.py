"""The disk tier's writer thread: stores, access bumps and drops, batched into one commit each.

Every operation goes through this one thread, and every commit through one thread of its own
(py-lmdb's rule: one write transaction at a time, used by the thread that made it);
``commit`` applies each batch.

A batch waits for more stores at most ``flush_interval_s`` after its oldest store was queued,
and not at all once it is full or a ``flush``/``close`` is queued behind it: one fdatasync and
one LMDB commit then serve many stores, and no store waits longer than that for its commit
while the device keeps up. Only the commit waits: the payloads go to the device while the
batch gathers, in runs of ``disk_stage_bytes`` (``BatchCommitter.stage``), so the device
works while callers still store; and a batch commits on the commit thread while the next one
gathers and stages, so the device works through the commit's syncs too. (Where the writer
waited for each commit, a 512 MiB burst on the 2-core VM left the device idle 2 to 6 ms at
each batch's end: the syncs wait for the device to drain, and the I/O thread, parked by then,
took milliseconds to wake for the next batch's first run.)

Each store learns its own outcome and no other's: its callers' ``on_done(True)`` once its entry
is committed (or was there already), ``on_done(False)`` if its batch failed (an I/O error, a
full map) or the writer stopped. A failed block is counted in ``blocks_dropped`` and logged,
one line per kind of failure per few seconds. ``on_done`` runs only once no reader is copying
from the block's pending bytes any more, so a ``write_behind`` caller may then reuse its buffer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lmdb

from kvtier.tiers.disk.commit import (
    FLUSH,
    PUT,
    STOP,
    TOUCH,
    BatchCommitter,
    DiskState,
    Event,
    Pending,
    StagedBatch,
)
from kvtier.tiers.tunables import TUNABLES

log = logging.getLogger(__name__)

OnEvent = Callable[[str, bytes, bytes], None]


class Flush:
    """A flush marker: set by the writer once every operation queued before it is done."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()


class DiskWriter:
    """The thread that commits queued operations in batches (``BatchCommitter``) and tells each
    store's callers its outcome."""

    def __init__(
        self,
        state: DiskState,
        capacity_blocks: int,
        batch_blocks: int,
        sync: bool,
        flush_interval_s: float,
        on_event: OnEvent | None,
    ) -> None:
        self._committer = BatchCommitter(state, capacity_blocks, sync)
        self._path = state.path
        self._drained = state.drained
        self._pending = state.pending
        self._pool = state.pool
        self._state = state
        self._failures = state.failures
        self._counters = state.counters
        self._batch_blocks = batch_blocks
        self._stage_blocks = max(1, TUNABLES.disk_stage_bytes // state.block_bytes)
        self._interval = flush_interval_s
        self._on_event = on_event
        self._queue: queue.SimpleQueue[tuple[int, Any, float]] = queue.SimpleQueue()
        # Commits run here, one at a time, while the writer thread gathers and stages the
        # next batch: an fdatasync waits for the device, and the device need not wait for it.
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-commit")
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="kvtier-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, op: int, arg: Any) -> None:
        """Queues one operation; call with the lock held, while ``alive``."""
        self._queue.put((op, arg, time.monotonic()))

    def join(self) -> None:
        self._thread.join()

    # ---- the thread ----

    def _run(self) -> None:
        batch: list[tuple[int, Any, float]] = []
        touches: list[tuple[int, Any, float]] = []
        committing: tuple[Future[None], list[tuple[int, Any, float]]] | None = None
        try:
            stop = False
            while not stop:
                batch = self._next_batch()
                stop = any(op == STOP for op, _, _ in batch)
                # Access-order bumps alone are not worth a synced commit per read burst: they
                # ride along with the next commit that stores, drops or flushes. A crash loses
                # only some LRU precision, never a block.
                if len(touches) + len(batch) < TUNABLES.disk_deferred_touches and all(
                    op == TOUCH for op, _, _ in batch
                ):
                    touches += batch
                    continue
                batch, touches = touches + batch, []
                sealed = self._committer.seal(self._stores_of(batch))
                if committing is not None:
                    committing[0].result()
                committing = (self._commits.submit(self._process, batch, sealed), batch)
                committing[0].add_done_callback(self._stop_if_failed)
                batch = []
        finally:
            # A commit that raised (a bug) told nobody: its batch fails with what is queued.
            if committing is not None and committing[0].exception() is not None:
                batch += committing[1]
            self._commits.shutdown()
            self._committer.close()
            with self._drained:
                self.alive = False
            # Nothing can be queued any more: fail what the thread may have died holding, and
            # what is still queued, so that no caller waits forever.
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._tell(self._retire([arg for op, arg, _ in batch if op == PUT], False), False)
            for op, arg, _ in batch:
                if op == FLUSH and not arg.done.is_set():
                    arg.finish(RuntimeError("disk tier writer stopped"))

    def _stop_if_failed(self, commit: Future[None]) -> None:
        """A commit that raised (a bug) stops the writer at once, whatever it waits for, as
        it did when commits ran on its own thread: nobody's flush waits forever."""
        if commit.exception() is not None:
            self._queue.put((STOP, None, time.monotonic()))

    def _next_batch(self) -> list[tuple[int, Any, float]]:
        """Blocks for one operation, then takes more until the batch holds ``batch_blocks``
        stores, a barrier (flush, stop) is taken, or the oldest store has waited
        ``flush_interval_s``; touches and drops alone never wait."""
        batch = [self._queue.get()]
        puts = batch[0][0] == PUT
        deadline = batch[0][2] + self._interval if puts else None
        barrier = batch[0][0] >= FLUSH
        staged, unstaged = 0, int(puts)
        while puts < self._batch_blocks:
            if unstaged >= self._stage_blocks:
                self._stage(batch[staged:])
                staged, unstaged = len(batch), 0
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                wait = None if deadline is None or barrier else deadline - time.monotonic()
                if wait is None or wait <= 0:
                    break
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
            batch.append(item)
            if item[0] == PUT:
                puts += 1
                unstaged += 1
                if deadline is None:
                    deadline = item[2] + self._interval
            barrier = barrier or item[0] >= FLUSH
        return batch

    def _stage(self, items: list[tuple[int, Any, float]]) -> None:
        """Writes the payloads of the stores among ``items`` now; the commit comes later."""
        stores = self._stores_of(items)
        if stores:
            self._committer.stage(stores)

    def _stores_of(self, items: list[tuple[int, Any, float]]) -> dict[bytes, Pending]:
        """The pending blocks of the stores among ``items``."""
        puts = [arg for op, arg, _ in items if op == PUT]
        if not puts:  # access bumps and drops alone: no lock to take
            return {}
        with self._drained:
            return {h: self._pending[h] for h in puts if h in self._pending}

    def _process(self, batch: list[tuple[int, Any, float]], sealed: StagedBatch) -> None:
        """On the commit thread: commits one batch, tells ``on_event`` and each store's
        callers, then releases the batch's flush markers (so a flush returns after the
        callbacks of what preceded it)."""
        ops = [(op, arg) for op, arg, _ in batch if op < FLUSH]
        puts = [arg for op, arg in ops if op == PUT]
        try:
            events, ok = self._committer.commit(ops, sealed)
        except (OSError, lmdb.Error) as exc:  # fails this batch's blocks, not the writer
            self._failures.warning(
                "write",
                "disk tier %s: a write failed, %d blocks not stored: %r",
                self._path,
                len(puts),
                exc,
            )
            events, ok = [], False
        callbacks = self._retire(puts, ok)
        self._announce(events)
        self._tell(callbacks, ok)
        for op, marker, _ in batch:
            if op == FLUSH:
                marker.finish(None)

    def _announce(self, events: list[Event]) -> None:
        if self._on_event is None:
            return
        for kind, block_hash, meta in events:
            try:
                self._on_event(kind, block_hash, meta)
            except Exception as exc:  # a subscriber's bug must not stop the disk tier
                self._failures.warning(
                    "on_event", "disk tier %s: on_event(%r) raised %r", self._path, kind, exc
                )

    def _retire(self, hashes: list[bytes], ok: bool) -> list[Callable[[bool], None]]:
        """Takes the stores out of the pending map (committed, or failed) once nobody copies
        from their bytes any more; returns their callers' ``on_done``."""
        callbacks: list[Callable[[bool], None]] = []
        with self._drained:
            for block_hash in hashes:
                pending = self._pending.pop(block_hash, None)
                if pending is None:
                    continue
                while pending.readers:
                    self._drained.wait()
                if pending.buf is not None:
                    self._pool.release(pending.buf)
                    self._state.copied_bytes -= self._state.block_bytes
                self._counters.blocks_dropped += not ok
                callbacks += pending.callbacks
        return callbacks

    def _tell(self, callbacks: list[Callable[[bool], None]], ok: bool) -> None:
        for on_done in callbacks:
            try:
                on_done(ok)
            except Exception as exc:  # the caller's bug must not stop the disk tier
                self._failures.warning(
                    "on_done", "disk tier %s: on_done raised %r", self._path, exc
                )
