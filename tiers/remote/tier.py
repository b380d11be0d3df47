"""The remote tier: blocks in a store shared by many nodes, below each node's disk tier.

What the daemon calls (every call is batched and bounded in time):

* ``lookup_prefix(hashes)``: how many leading blocks the store holds (one ``EXISTS`` round trip
  per endpoint, all endpoints at once);
* ``get_into(hashes, outs)``: fetches the leading blocks into the caller's buffers, each checked
  against its header and checksum (``format``), stopping at the first block it cannot
  deliver;
* ``write_behind(hash, data, meta, on_done)``: the disk tier's borrow contract. The block joins
  a bounded queue (a full one drops it at once, counted) and a writer thread stores it in
  batches, skipping blocks the store already holds (``writer``).

The store is a ``RemoteBackend``; capacity and eviction are its own. Nothing here waits longer
than its timeout or raises for the store's faults: an endpoint that is down, slow or failing
over gives counted misses (``fault_misses``), and after a few failed calls its circuit breaker
cuts it off until a probe finds it answering again (``routes``).

A call that times out returns while its worker may still be talking to the store; the borrowed
buffers are guarded (``Borrow``) so that no copy into an ``out`` or from a ``data`` starts
after the call has answered for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.buffers import copy_bytes
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.remote.backend import RemoteBackend, RemoteError
from kvtier.tiers.remote.format import block_key, check_prefix, unpack
from kvtier.tiers.remote.routes import Borrow, Routes
from kvtier.tiers.remote.writer import OnDone, RemoteWriter

log = logging.getLogger(__name__)


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


class RemoteTier:
    """Blocks of ``block_bytes`` of one layout in ``backend``, under the key ``prefix``.

    ``prefix`` is the namespace the daemon builds (``format.key_prefix``).
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
        self._lock = threading.Lock()
        self._routes = Routes(
            backend,
            self.counters,
            self._lock,
            threads=settings.connections,
            failures_to_open=settings.failures_to_open,
            probe_interval_s=settings.probe_interval_s,
            probe_timeout_s=settings.lookup_timeout_s,
        )
        self._writer = RemoteWriter(
            backend,
            self._routes,
            self.counters,
            self._lock,
            self._signature,
            block_bytes,
            self._prefix,
            max_queued=max(1, settings.queue_bytes // block_bytes),
            batch_blocks=settings.batch_blocks,
            pipeline_blocks=settings.pipeline_blocks,
            transfer_timeout_s=settings.transfer_timeout_s,
            on_event=on_event,
        )

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

        self._count_faults(
            self._routes.fan_out(keys, work, self.settings.lookup_timeout_s, len(keys))
        )
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
        borrow = Borrow()

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
                    copy_bytes(dsts[i], memoryview(value)[offset : offset + self.block_bytes])
                    metas[i] = meta
                finally:
                    borrow.end()

        started = time.perf_counter()
        missed = self._routes.fan_out(
            keys, work, self.settings.transfer_timeout_s, self.settings.pipeline_blocks
        )
        borrow.close()
        fetched = metas.index(None) if None in metas else len(metas)
        seconds = time.perf_counter() - started
        with self._lock:
            if fetched:  # the batch's bytes over its wall time: what a promotion waits for
                self.counters.observe_read(fetched * self.block_bytes, seconds)
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
        self._writer.write_behind(block_hash, data, meta, on_done)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every write queued before it has been stored or dropped.

        Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stores what is queued for up to ``timeout`` seconds (default: the transfer timeout),
        drops the rest, and closes the store's connections (idempotent)."""
        self._writer.close(self.settings.transfer_timeout_s if timeout is None else timeout)
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
