"""The host tier's LRU over committed slots nobody holds, kept as a log of uses.

A lookup pins or touches every one of its hits, up to 65,536 of them, and a release unpins
as many. In a doubly linked list each of those unlinks and relinks one slot: about 0.3 µs in
Python, so 0.3 ms for a 1,000-hash lookup, which set the daemon's slot-operation tail
(docs/performance.md, "What of a notice's work holds the eight-client tail"). Here the
order is a log of slots, oldest use first. Making a slot the most recently used appends it;
the entry it had before stops being its current one (each slot keeps the position of its
current entry), and leaving the LRU clears a flag. A batch of touches, pins or releases is
then a few numpy operations over the batch, and the order is still exactly LRU.

Taking the least recently used slot skips the stale entries at the head. Once the log is
twice as long as the LRU (plus some slack), it is compacted in numpy: stale entries dropped,
positions renumbered. So its memory stays bounded, and every entry costs one skip or one
compaction at most. Everything here is flat arrays (``array.array`` for the single items
Python reads fastest, numpy views of the same memory for batches); the caller holds the host
tier's lock around every call.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable

import numpy as np

SMALL_BATCH = 64
"""Batches shorter than this go slot by slot: numpy's few microseconds per call would cost
more than the Python loop (a 4-block load is the common case)."""

COMPACT_SLACK = 4096
"""Stale entries the log may carry beyond the LRU's own length before it is compacted."""


class Lru:
    """The LRU order of up to ``num_slots`` slots, with each member's last use."""

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._member = array("B", bytes(num_slots))
        self._entry = array("q", bytes(8 * num_slots))  # position of a slot's current entry
        self._last_use = array("d", bytes(8 * num_slots))
        self._member_np = np.frombuffer(self._member, dtype=np.uint8)
        self._entry_np = np.frombuffer(self._entry, dtype=np.int64)
        self._last_use_np = np.frombuffer(self._last_use, dtype=np.float64)
        self._log = array("i")  # slots, least recent use first; no numpy view outlives a call
        self._head = 0
        self.size = 0
        """Slots in the LRU."""

    def last_use(self, slot: int) -> float:
        return self._last_use[slot]

    # ---- one slot ----

    def push(self, slot: int) -> None:
        """Makes ``slot`` a member, the most recently used."""
        if not self._member[slot]:
            self._member[slot] = 1
            self.size += 1
        self._entry[slot] = len(self._log)
        self._log.append(slot)
        self._last_use[slot] = self._clock()
        self._compact_if_long()

    def remove(self, slot: int) -> None:
        """Takes ``slot`` out if it is a member."""
        if self._member[slot]:
            self._member[slot] = 0
            self.size -= 1

    def touch(self, slot: int) -> None:
        """Makes a member the most recently used; a slot outside stays out."""
        if self._member[slot]:
            self.push(slot)

    def pop(self) -> int | None:
        """Takes out the least recently used member."""
        if not self.size:
            self._clear_log()
            return None
        self._skip_stale()
        slot = self._log[self._head]
        self._head += 1
        self._member[slot] = 0
        self.size -= 1
        return slot

    def pop_many(self, count: int) -> list[int]:
        """Takes out the ``count`` least recently used members (fewer if it has fewer), the
        least recent first."""
        if count < SMALL_BATCH:
            taken = []
            while len(taken) < count and (slot := self.pop()) is not None:
                taken.append(slot)
            return taken
        taken_parts: list[np.ndarray] = []
        wanted = count
        while wanted and self.size and self._head < len(self._log):
            head = self._head
            end = min(len(self._log), head + max(2 * wanted, 1024))
            window = np.frombuffer(self._log, dtype=np.intc)[head:end]
            found = np.flatnonzero(self._current(window, np.arange(head, end)))[:wanted]
            slots = window[found]
            del window  # no view of the log outlives this turn
            self._member_np[slots] = 0
            self.size -= len(slots)
            wanted -= len(slots)
            taken_parts.append(slots)
            self._head = head + int(found[-1]) + 1 if not wanted else end
        if not self.size:
            self._clear_log()
        return np.concatenate(taken_parts).tolist() if taken_parts else []

    def oldest_age_s(self) -> float:
        """Seconds since the least recently used member was last used; 0.0 when empty."""
        if not self.size:
            return 0.0
        self._skip_stale()
        return max(0.0, self._clock() - self._last_use[self._log[self._head]])

    # ---- batches (numpy arrays of distinct slots) ----

    def touch_all(self, slots: np.ndarray) -> None:
        """``touch`` of each slot in order: the last becomes the most recently used."""
        self._append(slots[self._member_np[slots] != 0])

    def push_all(self, slots: np.ndarray) -> None:
        """``push`` of each slot in order."""
        self.size += int(np.count_nonzero(self._member_np[slots] == 0))
        self._member_np[slots] = 1
        self._append(slots)

    def remove_all(self, slots: np.ndarray) -> None:
        """``remove`` of each slot."""
        self.size -= int(np.count_nonzero(self._member_np[slots]))
        self._member_np[slots] = 0

    # ---- the log ----

    def _append(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        start = len(self._log)
        self._entry_np[slots] = np.arange(start, start + len(slots))
        self._last_use_np[slots] = self._clock()
        self._log.frombytes(slots.astype(np.intc).tobytes())
        self._compact_if_long()

    def _current(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Which of these log entries (slots at positions) are their slot's current one."""
        return (self._member_np[slots] != 0) & (self._entry_np[slots] == positions)

    def _skip_stale(self) -> None:
        """Moves the head to the oldest current entry (there is one: ``size`` > 0)."""
        log, member, entry, head = self._log, self._member, self._entry, self._head
        for _ in range(SMALL_BATCH):
            slot = log[head]
            if member[slot] and entry[slot] == head:
                self._head = head
                return
            head += 1
        window = 1024
        while True:
            end = min(len(log), head + window)
            found = np.flatnonzero(
                self._current(np.frombuffer(log, dtype=np.intc)[head:end], np.arange(head, end))
            )
            if found.size:
                self._head = head + int(found[0])
                return
            head, window = end, window * 4

    def _compact_if_long(self) -> None:
        if len(self._log) - self._head > 2 * self.size + COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        log = np.frombuffer(self._log, dtype=np.intc)[self._head :]
        current = log[self._current(log, np.arange(self._head, len(self._log)))]
        del log  # the log's memory must be free of views before it is replaced
        self._log = array("i", current.tobytes())
        self._entry_np[current] = np.arange(len(current))
        self._head = 0

    def _clear_log(self) -> None:
        if len(self._log):
            self._log = array("i")
            self._head = 0
