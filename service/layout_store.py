"""One layout's tiers in the daemon: its shared-memory arena as the host tier, the disk tier
below it, the remote tier below that (if any), and the counters, events and budgets that go
with them.

A layout (one model's KV shape: signature and block size) gets its own arena and its own
disk directory, so slots are one size per arena and never fragment, and each layout has its
own budget. Commits are write-behind: a committed block is readable in the host tier at once,
and the host tier writes it to the disk tier from its (pinned) slot in the disk writer's next
batch — never on the committing client's path; likewise to the remote tier, whose hits are
promoted into host slots (and the disk tier) before a client reads them. What the host and
disk tiers hold is published in the layout's lookup index (``proto.lookup_index``), beside the
arena, for clients to probe without a call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import lmdb
import numpy as np

from kvtier.proto.lookup_index import DISK as INDEX_DISK
from kvtier.proto.lookup_index import HOST as INDEX_HOST
from kvtier.proto.lookup_index import LookupIndexWriter
from kvtier.service.arena import Arena
from kvtier.service.events import STORED, EventHub
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.hashing import HASH_VERSION
from kvtier.tiers.host.admission import DEFAULT_POLICY, admission_policy
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.lower import NO_SPACE, NOT_ADMITTED, LowerHits
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.tier import RemoteTier

log = logging.getLogger(__name__)

HOST, DISK, REMOTE = "host", "disk", "remote"
INDEX_SCAN_BATCH = 16384
"""Disk entries read per transaction while publishing a reopened disk tier's blocks."""


class LayoutStore:
    """Host tier (the arena) → disk tier, for one layout signature and block size."""

    def __init__(
        self,
        signature: bytes,
        block_bytes: int,
        arena: Arena,
        disk_path: Path | None,
        disk_bytes: int,
        events: EventHub,
        *,
        disk_sync: bool = True,
        flush_interval_s: float = 1.0,
        remote: RemoteConfig | None = None,
        admission: str = DEFAULT_POLICY,
        index: Path | None = None,
        disk_read_delay_s: float = 0.0,
    ):
        """``index``: where to publish the lookup index (``proto.lookup_index``); None: not
        published."""
        self.signature = signature
        self.block_bytes = block_bytes
        self.arena = arena
        self.events = events
        tiers = (HOST, DISK, REMOTE) if remote is not None else (HOST, DISK)
        self.counters = {tier: TierCounters(tier) for tier in tiers}
        self.disk: DiskTier | None = None
        self.disk_state = "off"
        if disk_path is not None and disk_bytes > 0:
            self.disk = self._open_disk(
                disk_path, disk_bytes, disk_sync, flush_interval_s, disk_read_delay_s
            )
        self.remote: RemoteTier | None = None
        if remote is not None:
            self.remote = remote.open_tier(
                signature,
                block_bytes,
                HASH_VERSION,
                counters=self.counters[REMOTE],
                on_event=self._remote_event,
            )
        self.index = self._open_index(index, arena.size // block_bytes)
        self._index_disk()
        self.host = HostTier(
            block_bytes,
            arena.size,
            buffer=arena.array,
            lower=self.disk,
            remote=self.remote,
            write_behind=True,
            counters=self.counters[HOST],
            on_event=self._host_event,
            admission=admission_policy(admission, arena.size // block_bytes),
        )

    @property
    def num_slots(self) -> int:
        return self.host.num_slots

    def tier_counters(self) -> list[TierCounters]:
        """Every tier's counters, the disk's even when it is off or empty (capacity 0)."""
        return list(self.counters.values())

    def oldest_block_age_s(self, tier: str) -> float | None:
        """Seconds since the tier's least recently used block was last used (the disk's: an
        upper bound, about a second over); None where the tier keeps no such time (the remote
        store's own LRU) or none dates that block yet (a disk index from before it kept
        times)."""
        if tier == HOST:
            return self.host.oldest_block_age_s()
        if tier == DISK and self.disk is not None:
            return self.disk.oldest_block_age_s()
        return None

    # ---- operations (the daemon has validated ownership and arguments) ----

    @property
    def below_host(self) -> bool:
        """Whether a tier lies below the host tier: then a store or a lookup that misses the
        host tier may read the disk or the network (blocking)."""
        return self.disk is not None or self.remote is not None

    def lookup(
        self,
        hashes: Sequence[bytes],
        block_tokens: int,
        *,
        hold: bool,
        at_most: int | None = None,
        memory_only: bool = False,
        held: int = 0,
    ) -> tuple[LowerHits, list[tuple[bytes, int]]] | None:
        """(hits, [(hash, slot)] pinned when ``hold``: the first ``at_most`` host hits if
        given); see ``HostTier``. Blocking, unless ``memory_only``: then None, having changed
        nothing, where a tier below must be asked. ``held``: host hits of the lookup's prefix
        that come before ``hashes`` (its session holds them already), counted with them."""
        if memory_only:
            found = self.host.lookup_in_memory(hashes, hold, at_most)
            if found is None:
                return None
        elif hold:
            found = self.host.lookup_holding(hashes, at_most)
        else:
            found = self.host.lookup(hashes), []
        found[0].host += held
        self._count_lookup(held + len(hashes), found[0], block_tokens)
        return found

    def _count_lookup(self, asked: int, hits: LowerHits, block_tokens: int) -> None:
        for tier, hit in ((HOST, hits.host), (DISK, hits.disk), (REMOTE, hits.remote)):
            counters = self.counters.get(tier)
            if counters is None:
                break
            counters.query_tokens += asked * block_tokens
            counters.hit_tokens += hit * block_tokens
            asked -= hit

    def reserve(self, hashes: Sequence[bytes], metas: Sequence[bytes]) -> list[int]:
        """Slots, ``ALREADY_STORED`` or ``NO_SPACE`` (also for a block the admission policy
        turned away: the wire has no word for that, and to a client it is the same)."""
        slots = self.host.reserve(hashes, metas)
        return [NO_SPACE if slot == NOT_ADMITTED else slot for slot in slots]

    def reserve_unnamed(self, count: int) -> list[int]:
        return self.host.reserve_unnamed(count)

    def commit(self, slots: Sequence[int]) -> None:
        self.host.commit(slots)

    def commit_named(
        self, slots: Sequence[int], hashes: Sequence[bytes], metas: Sequence[bytes]
    ) -> int:
        return self.host.commit_named(slots, hashes, metas)

    def abort(self, slots: Sequence[int]) -> None:
        self.host.abort(slots)

    def acquire(
        self, hashes: Sequence[bytes], memory_only: bool = False
    ) -> tuple[list[int], LowerHits] | None:
        """Pins the held prefix of ``hashes``. Blocking (may read the disk), unless
        ``memory_only``: then None, having changed nothing, where a tier below must be read."""
        if memory_only:
            return self.host.acquire_in_memory(hashes)
        return self.host.acquire_with_sources(hashes)

    def release(self, slots: Sequence[int]) -> None:
        self.host.release(slots)

    def put_block(self, block_hash: bytes, meta: bytes, data: bytes) -> int:
        """Stores one block sent as bytes; returns 1, or the ``reserve`` code it got."""
        (slot,) = self.reserve([block_hash], [meta] if meta else ())
        if slot < 0:
            return slot
        try:
            self.host.slot_array(slot)[:] = np.frombuffer(data, dtype=np.uint8)
        except BaseException:
            self.host.abort([slot])
            raise
        self.host.commit([slot])
        return 1

    def read_slot(self, slot: int) -> bytes:
        return self.host.slot_array(slot).tobytes()

    def snapshot(self, after: bytes | None, limit: int) -> list[tuple[str, bytes, bytes]]:
        """A batch of (tier, hash, meta) of what the tiers hold, for announcing them.

        The host tier's blocks come in the first batch (``after`` None), then the disk tier's
        in key order after ``after``, ``limit`` at a time, until an empty batch.
        """
        if after is None:
            host = [(HOST, h, m) for h, m in self.host.snapshot()]
            disk = self.disk.scan(None, limit) if self.disk is not None else []
            return host + [(DISK, h, m) for h, m in disk]
        if self.disk is None:
            return []
        return [(DISK, h, m) for h, m in self.disk.scan(after, limit)]

    def close(self) -> None:
        """Flushes and closes the disk and remote tiers, then the index and the arena."""
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
        if self.index is not None:
            self.index.close()
        self.arena.close()

    # ---- internals ----

    def _open_disk(
        self, path: Path, budget: int, sync: bool, flush_interval_s: float, read_delay_s: float
    ) -> DiskTier | None:
        """The disk tier, or None (host only, said in stats and the log) if it cannot open."""
        try:
            disk = DiskTier(
                path,
                self.signature,
                self.block_bytes,
                budget,
                self.counters[DISK],
                self._disk_event,
                sync=sync,
                flush_interval_s=flush_interval_s,
                read_delay_s=read_delay_s,
            )
        except (OSError, RuntimeError, ValueError, lmdb.Error) as exc:
            # lmdb.Error: LMDB's own ENOSPC or map-full at open, which the disk tier raises
            # as it is (it is no damage to repair).
            self.disk_state = f"unavailable: {exc}"
            log.error(
                "layout %s: disk tier %s unavailable, host tier only: %s", self.hex, path, exc
            )
            return None
        self.disk_state = "ok"
        log.info(
            "layout %s: disk tier %s holds %d of %d blocks",
            self.hex,
            path,
            self.counters[DISK].used_blocks,
            self.counters[DISK].capacity_blocks,
        )
        return disk

    @property
    def hex(self) -> str:
        return self.signature.hex()

    def _open_index(self, path: Path | None, host_slots: int) -> LookupIndexWriter | None:
        """The lookup index, or None (clients then ask by calls) if it cannot be made."""
        if path is None:
            return None
        blocks = host_slots + self.counters[DISK].capacity_blocks
        try:
            return LookupIndexWriter(path, blocks, has_remote=self.remote is not None)
        except OSError as exc:
            log.warning(
                "layout %s: no lookup index at %s (%s); lookups go by calls", self.hex, path, exc
            )
            return None

    def _index_disk(self) -> None:
        """Publishes what a reopened disk tier holds (it announces nothing as it recovers)."""
        after = None
        while self.disk is not None and self.index is not None:
            batch = self.disk.scan(after, INDEX_SCAN_BATCH)
            if not batch:
                return
            self.index.set_all([block_hash for block_hash, _ in batch], INDEX_DISK)
            after = batch[-1][0]

    def _host_event(self, kind: str, blocks: list[tuple[bytes, bytes]]) -> None:
        self._indexed(kind, [block_hash for block_hash, _ in blocks], INDEX_HOST)
        for block_hash, meta in blocks:
            self.events.emit(kind, HOST, block_hash, meta, self.signature)

    def _disk_event(self, kind: str, block_hash: bytes, meta: bytes) -> None:
        self._indexed(kind, [block_hash], INDEX_DISK)
        self.events.emit(kind, DISK, block_hash, meta, self.signature)

    def _indexed(self, kind: str, hashes: list[bytes], tier: int) -> None:
        """Sets or clears ``tier``'s bit of each hash in the lookup index, under one lock."""
        if self.index is None:
            return
        if kind == STORED:
            self.index.set_all(hashes, tier)
        else:
            self.index.clear_all(hashes, tier)

    def _remote_event(self, kind: str, block_hash: bytes, meta: bytes) -> None:
        self.events.emit(kind, REMOTE, block_hash, meta, self.signature)
