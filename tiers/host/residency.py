"""Which blocks occupy the host tier's slots: claiming a slot for a hash, dropping it, and
making room by evicting the least recently used committed slots.

``HostTier`` owns one ``Residency``; every method is called with the host tier's lock held.
An evicted block goes down to the disk tier if that tier lacks it and the admission policy
sends it there; every change of occupancy is counted and announced ("removed").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host.admission import AdmissionPolicy
from kvtier.tiers.host.slots import READY, SlotTable
from kvtier.tiers.lower import ALREADY_STORED, NO_SPACE, NOT_ADMITTED, DiskTierLike

EventFn = Callable[[str, list[tuple[BlockHash, bytes]]], None]
"""Hears blocks of one kind ("stored" or "removed"), (hash, meta) each, a batch at a time: the
daemon's lookup index takes a batch under one lock."""


class Residency:
    def __init__(
        self,
        table: SlotTable,
        slab: np.ndarray,
        changed: threading.Condition,
        lower: DiskTierLike | None,
        admission: AdmissionPolicy,
        counters: TierCounters,
        on_event: EventFn | None,
    ):
        """``changed`` is the host tier's lock and condition, notified when a slot comes
        free; ``on_event("removed", blocks)`` hears each batch of evictions."""
        self._table = table
        self._slab = slab
        self._changed = changed
        self._lower = lower
        self._admission = admission
        self._counters = counters
        self._on_event = on_event
        self._block_bytes = slab.shape[1]

    # ``used_blocks`` counts blocks stored or being stored: a slot reserved unnamed holds no
    # block until its commit names one.

    def claim(self, slot: int, block_hash: BlockHash | None, meta: bytes) -> None:
        self._table.claim(slot, block_hash, meta)
        if block_hash is not None:
            self._used(1)

    def drop(self, slot: int, notify: bool = True) -> BlockHash | None:
        """Frees ``slot``; ``notify`` False leaves waking the waiters to the caller, who holds
        the lock (they run only once it is let go, so one notice for a batch does)."""
        block_hash = self._table.drop(slot)
        if block_hash is not None:
            self._admission.dropped(block_hash)
            self._used(-1)
        if notify:
            self._changed.notify_all()
        return block_hash

    def reserve(self, hashes: Sequence[BlockHash], metas: Sequence[bytes]) -> list[int]:
        """``HostTier.reserve``: a slot per hash, or why none."""
        # One question to the tier below (one read of its index) and one eviction a batch.
        fresh = {h for h in hashes if h not in self._table.index}
        below = self._held_below(fresh)
        evicted = self.make_room(len(fresh - below))
        if self._lower is not None:
            below |= evicted  # the tier below has each block evicted (spilled if need be)
        result: list[int] = []
        for i, h in enumerate(hashes):
            refusal = self._refusal(h, below)
            slot = self.take() if refusal is None else None
            if slot is None:
                result.append(NO_SPACE if refusal is None else refusal)
                continue
            self.claim(slot, h, metas[i] if metas else b"")
            result.append(slot)
        return result

    def reserve_unnamed(self, count: int) -> list[int]:
        """``HostTier.reserve_unnamed``."""
        self.make_room(count)
        slots = []
        while len(slots) < count and (slot := self.take()) is not None:
            self.claim(slot, None, b"")
            slots.append(slot)
        return slots

    def name(
        self, slots: Sequence[int], hashes: Sequence[BlockHash], metas: Sequence[bytes]
    ) -> list[int]:
        """Names unnamed slots for ``HostTier.commit_named``; frees those whose block needs
        no storing and returns the others."""
        below = self._held_below({h for h in hashes if h not in self._table.index})
        named = []
        for i, (slot, h) in enumerate(zip(slots, hashes, strict=True)):
            if self._refusal(h, below) is None:  # a hash named twice here: the first goes
                self._table.name(slot, h, metas[i] if metas else b"")
                self._used(1)
                named.append(slot)
            else:
                self.drop(slot, notify=False)
        if len(named) < len(slots):
            self._changed.notify_all()
        return named

    def _held_below(self, fresh: set[BlockHash]) -> set[BlockHash]:
        """Those of ``fresh`` (hashes not here) the disk tier holds: one read of its index."""
        return self._lower.holding(list(fresh)) if self._lower is not None and fresh else set()

    def _refusal(self, block_hash: BlockHash, below: set[BlockHash]) -> int | None:
        """Why ``block_hash`` needs no slot (counted), or None where it is to be stored."""
        if block_hash in self._table.index or block_hash in below:
            self._counters.blocks_deduplicated += 1
            return ALREADY_STORED
        if not self._admission.admit(block_hash):
            self._counters.blocks_not_admitted += 1
            return NOT_ADMITTED
        return None

    def _used(self, blocks: int) -> None:
        self._counters.used_blocks += blocks
        self._counters.used_bytes += blocks * self._block_bytes

    def take(self) -> int | None:
        """A free slot, evicting the LRU committed slot if need be."""
        self.make_room(1)
        return self._table.pop_free()

    def make_room(self, wanted: int) -> set[BlockHash]:
        """Evicts LRU committed slots until ``wanted`` slots are free (or none is left to
        evict), spilling into the disk tier those it lacks (asked once for them all);
        returns the hashes evicted."""
        table, lower = self._table, self._lower
        if table.free >= wanted:
            return set()
        victims = [
            (slot, table.hash_of(slot), table.meta.get(slot, b""))
            for slot in table.lru_pop_many(wanted - table.free)
        ]
        if not victims:
            return set()
        below = lower.holding([v for _, v, _ in victims]) if lower is not None else set()
        for slot, victim, meta in victims:
            if lower is not None and victim not in below:
                if self._admission.writes_down(victim):
                    # dropped (and counted there) when the disk is far behind
                    self._counters.blocks_spilled += lower.put(victim, self._slab[slot], meta)
                else:
                    self._counters.blocks_kept_off_disk += 1
            self._counters.blocks_evicted += 1
            self.drop(slot, notify=False)
        self._changed.notify_all()
        self.emit("removed", [(victim, meta) for _, victim, meta in victims])
        return {victim for _, victim, _ in victims}

    def emit(self, kind: str, blocks: list[tuple[BlockHash, bytes]]) -> None:
        if self._on_event is not None and blocks:
            self._on_event(kind, blocks)

    def spill_all(self) -> int:
        """``HostTier.spill_all``. None is shed for the disk's backlog: these copies are
        bounded by the host tier's size."""
        if self._lower is None:
            return 0
        table, down = self._table, self._admission.writes_down
        below = self._lower.holding(list(table.index))
        spilled = 0
        for block_hash, slot in list(table.index.items()):
            if table.state[slot] == READY and block_hash not in below and down(block_hash):
                self._lower.put(block_hash, self._slab[slot], table.meta.get(slot, b""), shed=False)
                spilled += 1
        self._counters.blocks_spilled += spilled
        return spilled
