"""The host tier's per-slot bookkeeping in a few flat arrays.

A host tier can have hundreds of thousands of slots, so nothing here is a Python object per
slot: state, reference counts and the LRU links are flat arrays (about 25 bytes a slot in
all). Only slots in use have an index entry (hash → slot) and, when the engine sent one, a
metadata entry; a slot's hash is read back through a list that refers to the index's own key
(8 bytes a slot, and no copy: rebuilding the hash from a numpy row cost about 0.8 µs, three
times per block stored and evicted). The LRU is an intrusive doubly linked list over the
unpinned committed slots, with one sentinel, so touching a slot is O(1) and allocates nothing;
each slot's last use (the clock's time when it last entered the LRU) tells the age of its head.
What a lookup reads and moves for every hit (state, reference counts, LRU links, last use) is
held in ``array.array``, whose single items Python reads and writes faster than a numpy
array's: a 1,000-hash lookup touches every one of its hits.
The caller (``HostTier``) holds its lock around every call.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable

import numpy as np

from kvtier.tiers.hashing import BlockHash

FREE, WRITING, READY = 0, 1, 2


class SlotTable:
    """State of ``num_slots`` slots: free stack, index, reference counts, LRU order."""

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic):
        self.num_slots = num_slots
        self._clock = clock
        self.state = array("B", bytes(num_slots))
        self.refs = array("i", bytes(4 * num_slots))
        self._hashes: list[BlockHash | None] = [None] * num_slots
        self.index: dict[BlockHash, int] = {}
        self.meta: dict[int, bytes] = {}
        # Free slots as a stack, lowest on top, so a fresh tier fills from slot 0 up.
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)
        self._num_free = num_slots
        # LRU links; index ``num_slots`` is the sentinel: its next is the least recently used.
        self._prev = array("i", b"\xff" * 4 * (num_slots + 1))
        self._next = array("i", b"\xff" * 4 * (num_slots + 1))
        self._sentinel = num_slots
        self._prev[num_slots] = self._next[num_slots] = num_slots
        self.lru_len = 0
        self._last_use = array("d", bytes(8 * num_slots))

    # ---- slots ----

    @property
    def used(self) -> int:
        return self.num_slots - self._num_free

    @property
    def free(self) -> int:
        return self._num_free

    def hash_of(self, slot: int) -> BlockHash:
        return self._hashes[slot]

    def ready_slot(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash`` readable, else None."""
        slot = self.index.get(block_hash)
        return slot if slot is not None and self.state[slot] == READY else None

    def pop_free(self) -> int | None:
        if not self._num_free:
            return None
        self._num_free -= 1
        return int(self._free[self._num_free])

    def claim(self, slot: int, block_hash: BlockHash, meta: bytes) -> None:
        """Names a free slot by its hash, unreadable (being written) until ``state`` says."""
        self.state[slot] = WRITING
        self._hashes[slot] = block_hash
        self.index[block_hash] = slot
        if meta:
            self.meta[slot] = meta

    def drop(self, slot: int) -> BlockHash:
        """Forgets the slot's block and frees it; returns the hash it held."""
        block_hash = self._hashes[slot]
        self._hashes[slot] = None
        del self.index[block_hash]
        self.meta.pop(slot, None)
        self.state[slot] = FREE
        self.refs[slot] = 0
        self._free[self._num_free] = slot
        self._num_free += 1
        return block_hash

    # ---- LRU over committed slots nobody holds ----

    def lru_push(self, slot: int) -> None:
        """Makes ``slot`` the most recently used."""
        sentinel = self._sentinel
        last = self._prev[sentinel]
        self._prev[slot] = last
        self._next[slot] = sentinel
        self._next[last] = slot
        self._prev[sentinel] = slot
        self.lru_len += 1
        self._last_use[slot] = self._clock()

    def lru_remove(self, slot: int) -> None:
        """Takes ``slot`` out of the LRU if it is in it."""
        prev = self._prev[slot]
        if prev < 0:
            return
        nxt = self._next[slot]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[slot] = self._next[slot] = -1
        self.lru_len -= 1

    def lru_pop(self) -> int | None:
        """Takes the least recently used slot out of the LRU."""
        slot = int(self._next[self._sentinel])
        if slot == self._sentinel:
            return None
        self.lru_remove(slot)
        return slot

    def oldest_age_s(self) -> float:
        """Seconds since the least recently used slot was last used; 0.0 with an empty LRU."""
        slot = self._next[self._sentinel]
        if slot == self._sentinel:
            return 0.0
        return max(0.0, self._clock() - float(self._last_use[slot]))

    def touch(self, slot: int) -> None:
        """Makes an unpinned committed slot the most recently used (a pinned one stays out)."""
        if self._prev[slot] >= 0:
            self.lru_remove(slot)
            self.lru_push(slot)

    def pin(self, slot: int) -> None:
        """One more holder (a reader or a write behind); a held slot is never evicted."""
        if self.refs[slot] == 0:
            self.lru_remove(slot)
        self.refs[slot] += 1

    def unpin(self, slot: int) -> None:
        """One holder fewer; the last one puts the slot back into the LRU as most recent."""
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.lru_push(slot)

    # Batch forms of ``touch``, ``pin`` and ``unpin`` for a lookup's or a release's many slots:
    # the link updates are inlined and the clock is read once, since a 1,000-hash lookup pays
    # these per hit (the single forms above stay the reference for what each step does).

    def touch_all(self, slots: Iterable[int]) -> None:
        """``touch`` of each slot in order (the last becomes the most recently used)."""
        prev, nxt, sentinel, last_use = self._prev, self._next, self._sentinel, self._last_use
        now = self._clock()
        for slot in slots:
            before = prev[slot]
            if before < 0:
                continue
            after = nxt[slot]
            nxt[before] = after
            prev[after] = before
            last = prev[sentinel]
            prev[slot] = last
            nxt[slot] = sentinel
            nxt[last] = slot
            prev[sentinel] = slot
            last_use[slot] = now

    def pin_all(self, slots: Iterable[int]) -> None:
        """``pin`` of each slot."""
        prev, nxt, refs = self._prev, self._next, self.refs
        for slot in slots:
            if refs[slot] == 0:
                before = prev[slot]
                if before >= 0:
                    after = nxt[slot]
                    nxt[before] = after
                    prev[after] = before
                    prev[slot] = nxt[slot] = -1
                    self.lru_len -= 1
            refs[slot] += 1

    def unpin_all(self, slots: Iterable[int]) -> None:
        """``unpin`` of each slot in order (a slot let go last is the most recently used)."""
        prev, nxt, sentinel, last_use, refs = (
            self._prev,
            self._next,
            self._sentinel,
            self._last_use,
            self.refs,
        )
        now = self._clock()
        for slot in slots:
            refs[slot] -= 1
            if refs[slot] == 0:
                last = prev[sentinel]
                prev[slot] = last
                nxt[slot] = sentinel
                nxt[last] = slot
                prev[sentinel] = slot
                self.lru_len += 1
                last_use[slot] = now

    def snapshot(self) -> list[tuple[BlockHash, bytes]]:
        """Every readable block's hash and metadata."""
        return [
            (h, self.meta.get(slot, b""))
            for h, slot in self.index.items()
            if self.state[slot] == READY
        ]
