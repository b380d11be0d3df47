"""The host tier's per-slot bookkeeping in a few flat arrays.

A host tier can have hundreds of thousands of slots, so nothing here is a Python object per
slot: state, reference counts and the LRU (``kvtier.tiers.host.lru``) are flat arrays (about
30 bytes a slot in all, plus the LRU's log). Only slots in use have an index entry (hash →
slot) and, when the engine sent one, a metadata entry; a slot's hash is read back through a
list that refers to the index's own key (8 bytes a slot, and no copy: rebuilding the hash
from a numpy row cost about 0.8 µs, three times per block stored and evicted).
A 1,000-hash lookup reads, pins or touches every one of its hits, so those run as numpy
operations over the batch (``ready_run`` and the ``*_all`` forms); the single-slot forms,
for the short batches of loads and stores, read ``array.array`` items, which Python reads and
writes faster than a numpy array's. The caller (``HostTier``) holds its lock around every call.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host.lru import SMALL_BATCH, Lru

FREE, WRITING, READY = 0, 1, 2


class SlotTable:
    """State of ``num_slots`` slots: free stack, index, reference counts, LRU order."""

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic):
        self.num_slots = num_slots
        self.state = array("B", bytes(num_slots))
        self.refs = array("i", bytes(4 * num_slots))
        self._hashes: list[BlockHash | None] = [None] * num_slots
        self.index: dict[BlockHash, int] = {}
        self.meta: dict[int, bytes] = {}
        # Free slots as a stack, lowest on top, so a fresh tier fills from slot 0 up.
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)
        self._num_free = num_slots
        self._state_np = np.frombuffer(self.state, dtype=np.uint8)
        self._refs_np = np.frombuffer(self.refs, dtype=np.int32)
        self._scratch = np.zeros(num_slots, dtype=np.int32)  # ``_distinct``'s positions
        self._lru = Lru(num_slots, clock)

    # ---- slots ----

    @property
    def used(self) -> int:
        return self.num_slots - self._num_free

    @property
    def free(self) -> int:
        return self._num_free

    def hash_of(self, slot: int) -> BlockHash | None:
        """The hash a slot in use holds; None for one reserved unnamed."""
        return self._hashes[slot]

    def ready_slot(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash`` readable, else None."""
        slot = self.index.get(block_hash)
        return slot if slot is not None and self.state[slot] == READY else None

    def ready_run(self, hashes: Sequence[BlockHash], start: int = 0) -> list[int]:
        """The slots of the longest run of ``hashes`` from ``start`` readable here.

        Read in chunks, each one pass of dict lookups in C and one numpy check of their
        states, so a 65,536-hash lookup that misses early reads little beyond its miss."""
        run: list[int] = []
        get, state = self.index.get, self.state
        chunk = SMALL_BATCH
        while start < len(hashes):
            slots = list(map(get, hashes[start : start + chunk]))
            looked = len(slots)
            if None in slots:
                del slots[slots.index(None) :]
            if len(slots) <= SMALL_BATCH:
                ready = next((i for i, slot in enumerate(slots) if state[slot] != READY), None)
            else:
                unready = np.flatnonzero(
                    self._state_np[np.fromiter(slots, dtype=np.intp, count=len(slots))] != READY
                )
                ready = int(unready[0]) if unready.size else None
            if ready is not None:
                del slots[ready:]
            run += slots
            if len(slots) < looked:
                break
            start, chunk = start + looked, min(chunk * 4, 4096)
        return run

    def pop_free(self) -> int | None:
        if not self._num_free:
            return None
        self._num_free -= 1
        return int(self._free[self._num_free])

    def claim(self, slot: int, block_hash: BlockHash | None, meta: bytes) -> None:
        """Takes a free slot to be written, unreadable until ``state`` says, named by its hash
        now or (``block_hash`` None: reserved unnamed) by ``name`` before its commit."""
        self.state[slot] = WRITING
        if block_hash is not None:
            self.name(slot, block_hash, meta)

    def name(self, slot: int, block_hash: BlockHash, meta: bytes) -> None:
        self._hashes[slot] = block_hash
        self.index[block_hash] = slot
        if meta:
            self.meta[slot] = meta

    def drop(self, slot: int) -> BlockHash | None:
        """Forgets the slot's block and frees it; returns the hash it held (None: unnamed)."""
        block_hash = self._hashes[slot]
        self._hashes[slot] = None
        if block_hash is not None:
            del self.index[block_hash]
        self.meta.pop(slot, None)
        self.state[slot] = FREE
        self.refs[slot] = 0
        self._free[self._num_free] = slot
        self._num_free += 1
        return block_hash

    # ---- LRU over committed slots nobody holds (``Lru``) ----

    @property
    def lru_len(self) -> int:
        return self._lru.size

    def lru_push(self, slot: int) -> None:
        """Makes ``slot`` the most recently used."""
        self._lru.push(slot)

    def lru_remove(self, slot: int) -> None:
        """Takes ``slot`` out of the LRU if it is in it."""
        self._lru.remove(slot)

    def lru_pop(self) -> int | None:
        """Takes the least recently used slot out of the LRU."""
        return self._lru.pop()

    def lru_pop_many(self, count: int) -> list[int]:
        """Takes the ``count`` least recently used slots out of the LRU (fewer if it has
        fewer), the least recent first."""
        return self._lru.pop_many(count)

    def oldest_age_s(self) -> float:
        """Seconds since the least recently used slot was last used; 0.0 with an empty LRU."""
        return self._lru.oldest_age_s()

    def last_use(self, slot: int) -> float:
        return self._lru.last_use(slot)

    def touch(self, slot: int) -> None:
        """Makes an unpinned committed slot the most recently used (a pinned one stays out)."""
        self._lru.touch(slot)

    def pin(self, slot: int) -> None:
        """One more holder (a reader or a write behind); a held slot is never evicted."""
        if self.refs[slot] == 0:
            self._lru.remove(slot)
        self.refs[slot] += 1

    def unpin(self, slot: int) -> None:
        """One holder fewer; the last one puts the slot back into the LRU as most recent."""
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._lru.push(slot)

    # Batch forms of ``touch``, ``pin`` and ``unpin`` for a lookup's or a release's many
    # slots: a long batch of distinct slots is a few numpy operations; a short one, or one
    # that names a slot twice (whose order the single forms define), goes slot by slot.

    def touch_all(self, slots: Sequence[int]) -> None:
        """``touch`` of each slot in order (the last becomes the most recently used)."""
        batch = self._distinct(slots)
        if batch is None:
            for slot in slots:
                self._lru.touch(slot)
        else:
            self._lru.touch_all(batch)

    def pin_all(self, slots: Sequence[int]) -> None:
        """``pin`` of each slot."""
        batch = self._distinct(slots)
        if batch is None:
            for slot in slots:
                self.pin(slot)
            return
        refs = self._refs_np[batch]
        self._lru.remove_all(batch[refs == 0])
        self._refs_np[batch] = refs + 1

    def unpin_all(self, slots: Sequence[int]) -> None:
        """``unpin`` of each slot in order (a slot let go last is the most recently used)."""
        batch = self._distinct(slots)
        if batch is None:
            for slot in slots:
                self.unpin(slot)
            return
        refs = self._refs_np[batch] - 1
        self._refs_np[batch] = refs
        self._lru.push_all(batch[refs == 0])

    def check_release(self, slots: Sequence[int]) -> None:
        """Raises ``ValueError`` unless each slot is readable and pinned at least as often as
        ``slots`` names it."""
        if len(slots) < SMALL_BATCH:
            for slot, times in Counter(slots).items():
                if not 0 <= slot < self.num_slots or self.state[slot] != READY:
                    raise ValueError(f"release: slot {slot} is not in the state release needs")
                if self.refs[slot] < times:
                    raise ValueError(f"slot {slot} released more often than acquired")
            return
        batch, times = np.unique(np.asarray(slots, dtype=np.intp), return_counts=True)
        outside = (batch < 0) | (batch >= self.num_slots)
        if outside.any():
            raise ValueError(f"release: slot {batch[outside][0]} is not in the state release needs")
        unready = np.flatnonzero(self._state_np[batch] != READY)
        if unready.size:
            raise ValueError(f"release: slot {batch[unready[0]]} is not in the state release needs")
        short = np.flatnonzero(self._refs_np[batch] < times)
        if short.size:
            raise ValueError(f"slot {batch[short[0]]} released more often than acquired")

    def _distinct(self, slots: Sequence[int]) -> np.ndarray | None:
        """``slots`` as an array if the batch is long and names each slot once, else None.

        Each slot's position is written into a scratch array and read back: where a slot
        appears twice, one of its positions reads back the other's."""
        if len(slots) < SMALL_BATCH:
            return None
        batch = np.fromiter(slots, dtype=np.intp, count=len(slots))
        positions = np.arange(len(batch), dtype=np.int32)
        self._scratch[batch] = positions
        return batch if np.array_equal(self._scratch[batch], positions) else None

    def snapshot(self) -> list[tuple[BlockHash, bytes]]:
        """Every readable block's hash and metadata."""
        return [
            (h, self.meta.get(slot, b""))
            for h, slot in self.index.items()
            if self.state[slot] == READY
        ]
