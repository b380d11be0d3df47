"""The host tier: one slab of (pinned) host memory cut into block-sized slots.

A hash→slot index, LRU over committed slots nobody holds, and two-phase transfers:

* store: ``reserve`` → the caller writes the slot → ``commit`` (or ``abort``). A reserved slot
  is in the index, so nobody reserves the same hash twice, but it is never readable.
* load: ``acquire`` → the caller reads the slot → ``release``. An acquired slot is never
  evicted. Acquiring a hash that only a lower tier holds promotes it into a slot first.

Below it may sit a disk tier and a remote tier. With ``write_behind`` (the daemon), every
commit is readable at once and is also written to those tiers from its slot, which stays
pinned until they are done; otherwise (an engine's own stack) a block reaches the disk tier
when its slot is evicted (spill). Either way eviction takes the least recently used slot,
and a prefix enters the LRU tail first, so its tail is evicted before its head and a prefix
partly in this tier never cascades through the disk on its next acquire. An admission policy
(``kvtier.tiers.host.admission``) decides which offered blocks enter and which go to disk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash, check_hashes
from kvtier.tiers.host.admission import AdmissionPolicy, AdmitAll
from kvtier.tiers.host.behind import Below, WriteBehind
from kvtier.tiers.host.promote import Promoter, SlotOps
from kvtier.tiers.host.residency import EventFn, Residency
from kvtier.tiers.host.slab import Slab
from kvtier.tiers.host.slots import READY, WRITING, SlotTable
from kvtier.tiers.lower import (
    MAX_META_BYTES,
    DiskTierLike,
    LowerHits,
    RemoteTierLike,
)

if TYPE_CHECKING:
    import torch


class HostTier:
    """Fixed-slot block store in host memory over an optional disk and remote tier."""

    def __init__(
        self,
        block_bytes: int,
        capacity_bytes: int,
        *,
        buffer: np.ndarray | None = None,
        pin: bool | None = None,
        lower: DiskTierLike | None = None,
        remote: RemoteTierLike | None = None,
        write_behind: bool = False,
        counters: TierCounters | None = None,
        on_event: EventFn | None = None,
        admission: AdmissionPolicy | None = None,
    ):
        """``on_event(kind, hash, meta)`` hears "stored" and "removed"; it may run under the
        tier's lock, so it must only hand the event on (a queue), never call back into it.
        ``admission`` (default: admit all, write all down) is called under the lock too."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"host capacity {capacity_bytes} B holds no block of {block_bytes} B")
        for tier in (lower, remote):
            if tier is not None and tier.block_bytes != block_bytes:
                raise ValueError(
                    f"a lower tier's blocks are {tier.block_bytes} B, not {block_bytes}"
                )
        self.block_bytes, self.num_slots = block_bytes, num_slots
        self._memory = Slab(num_slots, block_bytes, buffer, pin)
        self._slab_np = self._memory.array
        self.lower, self.remote = lower, remote
        self._below = lower is not None or remote is not None
        """Whether an in-memory answer may fall short: a tier below may hold what this lacks."""
        self.counters = counters or TierCounters("host")
        self.counters.capacity_blocks = num_slots
        self.counters.capacity_bytes = num_slots * block_bytes
        self.admission = admission or AdmitAll()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified when a promotion ends or a slot may have come free."""
        self._slots = SlotTable(num_slots)
        self._room = Residency(
            self._slots,
            self._slab_np,
            self._changed,
            lower,
            self.admission,
            self.counters,
            on_event,
        )
        below = [t for t in (lower, remote) if t is not None] if write_behind else []
        self._behind = WriteBehind(below, lower, self._changed, self._slots, self._slab_np)
        self._promoter = Promoter(
            SlotOps(
                self._changed,
                self._slots,
                self._slab_np,
                self._room.take,
                self._room.claim,
                self._room.drop,
                self._room.emit,
                self._behind,
            ),
            lower,
            remote,
            self.counters,
        )

    @property
    def reclaim(self) -> Callable[[], bool] | None:
        """Set by the daemon: ends the oldest lookup hold when a promotion finds every slot
        pinned (a hold only keeps a host hit where the lookup saw it; a disk hit the engine
        was promised would otherwise fail); True if it ended one. Called without the lock."""
        return self._promoter.reclaim

    @reclaim.setter
    def reclaim(self, reclaim: Callable[[], bool] | None) -> None:
        self._promoter.reclaim = reclaim

    @property
    def slab(self) -> torch.Tensor:
        """uint8 ``[num_slots, block_bytes]``: the slots, for an engine's copy engine."""
        return self._memory.tensor

    # ---- queries ----

    def contains(self, block_hash: BlockHash) -> bool:
        """True if a committed slot holds ``block_hash``."""
        return self._slots.ready_slot(block_hash) is not None

    def lookup(self, hashes: Sequence[BlockHash]) -> LowerHits:
        """The contiguous prefix of ``hashes`` that this tier or the ones below hold.

        The host and disk part is one consistent walk under the lock; what neither holds is
        asked of the remote tier in one batched call, outside the lock (it is a network call).
        The host hits become the most recently used (the prefix's head last), so that other
        promotions meanwhile evict colder blocks and the acquire that follows finds here what
        this answer says is here.
        """
        return self._lookup(hashes, hold=False)[0]

    def lookup_holding(
        self, hashes: Sequence[BlockHash], at_most: int | None = None
    ) -> tuple[LowerHits, list[tuple[BlockHash, int]]]:
        """``lookup``, its host hits (the first ``at_most``) pinned as by ``acquire`` in the
        same critical section: (hits, [(hash, slot)] pinned); give them back by ``release``."""
        return self._lookup(hashes, hold=True, at_most=at_most)

    def lookup_in_memory(
        self, hashes: Sequence[BlockHash], hold: bool, at_most: int | None = None
    ) -> tuple[LowerHits, list[tuple[BlockHash, int]]] | None:
        """``lookup`` (``hold`` False) or ``lookup_holding`` (True) when this tier's memory
        alone answers it: every hash is here, or no tier lies below. Otherwise None, having
        changed nothing: a tier below must be asked, which may read the disk or the network."""
        check_hashes(hashes)
        with self._lock:
            slots = self._slots.ready_run(hashes)
            if len(slots) < len(hashes) and self._below:
                return None
            pinned = self._mark_read(hashes[: len(slots)], slots, hold, at_most)
        return LowerHits(host=len(slots)), pinned

    def _lookup(
        self, hashes: Sequence[BlockHash], hold: bool, at_most: int | None = None
    ) -> tuple[LowerHits, list[tuple[BlockHash, int]]]:
        check_hashes(hashes)
        hits = LowerHits()
        pos, n = 0, len(hashes)
        hit_hashes: list[BlockHash] = []
        hit_slots: list[int] = []
        with self._lock:
            table = self._slots
            while pos < n:
                run = table.ready_run(hashes, pos)
                if run:
                    hit_hashes += hashes[pos : pos + len(run)]
                    hit_slots += run
                    pos += len(run)
                    continue
                run = self.lower.lookup_prefix(hashes[pos:]) if self.lower else 0
                if run == 0:
                    break
                for h in hashes[pos : pos + run]:
                    slot = table.ready_slot(h)
                    if slot is not None:
                        hit_hashes.append(h)
                        hit_slots.append(slot)
                    else:
                        hits.disk += 1
                pos += run
            self.admission.looked_up(h for h in hashes[pos:] if h not in table.index)
            pinned = self._mark_read(hit_hashes, hit_slots, hold, at_most)
        hits.host = len(hit_slots)
        if pos < n and self.remote is not None:
            hits.remote = self.remote.lookup_prefix(hashes[pos:])
        return hits, pinned

    def _mark_read(
        self, hashes: Sequence[BlockHash], slots: list[int], hold: bool, at_most: int | None
    ) -> list[tuple[BlockHash, int]]:
        """Pins (``hold``: the first ``at_most``, if given) a lookup's host hits (``hashes``
        in ``slots``) and touches the rest, head last; returns those pinned (hash, slot).
        Call under the lock."""
        held = (len(slots) if at_most is None else min(at_most, len(slots))) if hold else 0
        self._slots.touch_all(slots[held:][::-1])
        self._slots.pin_all(slots[:held][::-1])
        return list(zip(hashes[:held], slots[:held], strict=True))

    @property
    def writing_behind(self) -> int:
        """Blocks (committed or promoted) whose write to a tier below has not finished."""
        with self._lock:
            return len(self._behind)

    def oldest_block_age_s(self) -> float:
        with self._lock:
            return self._slots.oldest_age_s()

    def slot_array(self, slot: int) -> np.ndarray:
        """The bytes of one slot as a writable numpy view (no copy)."""
        return self._slab_np[slot]

    def meta_of(self, slot: int) -> bytes:
        with self._lock:
            return self._slots.meta.get(slot, b"")

    def snapshot(self) -> list[tuple[BlockHash, bytes]]:
        """(hash, meta) of every block readable here now."""
        with self._lock:
            return self._slots.snapshot()

    # ---- store ----

    def reserve(self, hashes: Sequence[BlockHash], metas: Sequence[bytes] = ()) -> list[int]:
        """A slot per hash, or ``ALREADY_STORED``, ``NO_SPACE`` or ``NOT_ADMITTED`` where none.

        The hash is claimed at once (a second reserve of it sees ``ALREADY_STORED``) but the
        slot is unreadable until ``commit``. ``metas``, if given, holds each block's engine
        metadata, kept with the block in every tier."""
        check_hashes(hashes)
        _check_metas(metas, len(hashes))
        with self._lock:
            return self._room.reserve(hashes, metas)

    def reserve_unnamed(self, count: int) -> list[int]:
        """Up to ``count`` slots (fewer where none is left to evict), to be written before
        their hashes are known: each is named by ``commit_named``, or given back by ``abort``.
        A client that keeps some reserved ahead stores without waiting for a Reserve."""
        with self._lock:
            return self._room.reserve_unnamed(count)

    def commit_named(
        self, slots: Sequence[int], hashes: Sequence[BlockHash], metas: Sequence[bytes] = ()
    ) -> int:
        """``commit`` of slots from ``reserve_unnamed``, each named now by its hash in
        ``hashes`` (and its metadata in ``metas``). A block stored already, here or in the
        disk tier, or one the admission policy turns away, is not stored: its slot is freed.
        Returns how many were not stored."""
        check_hashes(hashes)
        _check_metas(metas, len(hashes))
        if len(hashes) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"commit: {len(hashes)} hashes for {len(slots)} distinct slots")
        with self._lock:
            for slot in slots:
                self._check_state(slot, WRITING, "commit")
                if self._slots.hash_of(slot) is not None:
                    raise ValueError(f"commit: slot {slot} was reserved by its hash, not unnamed")
            named = self._room.name(slots, hashes, metas)
        self.commit(named)
        return len(slots) - len(named)

    def commit(self, slots: Sequence[int]) -> None:
        """Makes reserved slots readable; their hashes are now stored here.

        ``slots`` are taken in chain order (a prefix head first): they enter the LRU tail
        first. With ``write_behind`` each is written to the tiers below from its slot, pinned
        until they are done."""
        committed: list[tuple[int, BlockHash, bytes, list[Below]]] = []
        with self._lock:
            table = self._slots
            for slot in slots:
                self._check_state(slot, WRITING, "commit")
                if table.hash_of(slot) is None:
                    raise ValueError(f"commit: slot {slot} is unnamed (see commit_named)")
            for slot in reversed(slots):
                table.state[slot] = READY
                block_hash, meta = table.hash_of(slot), table.meta.get(slot, b"")
                below = self._behind.tiers(disk=self.admission.writes_down(block_hash))
                committed.append((slot, block_hash, meta, below))
                self._behind.pin(slot, below)
                if not below:
                    table.lru_push(slot)
                self.counters.blocks_stored += 1
                self.counters.bytes_in += self.block_bytes
            self._room.emit("stored", [(block_hash, meta) for _, block_hash, meta, _ in committed])
        for block in committed:
            self._behind.start(*block)

    def abort(self, slots: Sequence[int]) -> None:
        """Gives reserved slots back unwritten; their hashes are not stored."""
        with self._lock:
            for slot in slots:
                self._check_state(slot, WRITING, "abort")
            for slot in slots:
                self._room.drop(slot)

    # ---- load ----

    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pins slots holding ``hashes`` for reading; see ``acquire_with_sources``."""
        return self.acquire_with_sources(hashes)[0]

    def acquire_with_sources(self, hashes: Sequence[BlockHash]) -> tuple[list[int], LowerHits]:
        """Pins slots holding ``hashes``, promoting lower-tier hits; says where each was.

        Every block already here is pinned first, so promoting the others can never evict a
        block this call is about to hand out. The result stops at the first hash that no tier
        can supply (gone since the lookup, no free slot, a checksum miss), so it is a prefix
        of ``hashes``; every returned slot must be given back with ``release``.
        """
        return self._acquire(hashes, memory_only=False)

    def acquire_in_memory(self, hashes: Sequence[BlockHash]) -> tuple[list[int], LowerHits] | None:
        """``acquire_with_sources`` when this tier's memory alone answers it: every hash is
        here, or no tier lies below. Otherwise None, having changed nothing: a promotion may
        read the disk or the network."""
        return self._acquire(hashes, memory_only=True)

    def _acquire(
        self, hashes: Sequence[BlockHash], memory_only: bool
    ) -> tuple[list[int], LowerHits] | None:
        check_hashes(hashes)
        sources = LowerHits()
        late: list[tuple[int, BlockHash, bytes, list[Below]]] = []  # now worth a disk write behind
        with self._lock:
            found = [self._slots.ready_slot(h) for h in hashes]
            if memory_only and self._below and None in found:
                return None
            for h, slot in zip(hashes, found, strict=True):
                if slot is not None:
                    self._slots.pin(slot)
                    if self.admission.hit(h) and (disk := self._behind.missing_on_disk(h)):
                        self._behind.pin(slot, disk)
                        late.append((slot, h, self._slots.meta.get(slot, b""), disk))
        for block in late:
            self._behind.start(*block)
        acquired: list[int] = []
        pos = 0
        while pos < len(hashes):
            slot = found[pos]
            if slot is not None:
                sources.host += 1
                acquired.append(slot)
                pos += 1
                continue
            run = self._promoter.promote(hashes, found, pos, sources)
            if not run:
                break
            acquired += run
            pos += len(run)
        with self._lock:
            for slot in found[pos:]:
                if slot is not None:
                    self._slots.unpin(slot)
            self.counters.blocks_loaded += len(acquired)
            self.counters.bytes_out += len(acquired) * self.block_bytes
        return acquired, sources

    def release(self, slots: Sequence[int]) -> None:
        """Ends reads begun by ``acquire``; a prefix is released tail first into the LRU."""
        with self._lock:
            self._slots.check_release(slots)
            self._slots.unpin_all(list(reversed(slots)))
            self._changed.notify_all()

    def spill_all(self) -> int:
        """Copies every committed block the disk tier lacks into it (graceful shutdown),
        if the admission policy sends it down. Returns how many; the slots stay valid."""
        with self._lock:
            return self._room.spill_all()

    def _check_state(self, slot: int, want: int, op: str) -> None:
        if not 0 <= slot < self.num_slots or self._slots.state[slot] != want:
            raise ValueError(f"{op}: slot {slot} is not in the state {op} needs")


def _check_metas(metas: Sequence[bytes], blocks: int) -> None:
    if metas and len(metas) != blocks:
        raise ValueError(f"{len(metas)} metas for {blocks} hashes")
    for meta in metas:
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"block metadata of {len(meta)} B exceeds {MAX_META_BYTES} B")
