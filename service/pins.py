"""Pins: blocks a session keeps in one layout's host tier for a while, e.g. an agent's context
between its tool calls, which the LRU would otherwise evict under other engines' stores.

A pin holds the block's host slot through the host tier's own reference count (as a read
does), so the LRU never sees it until the last pin of it lapses. Each session may hold at
most ``budget`` pins; a pin beyond that is refused and counted. Two sessions pinning one block
hold two pins of it (each against its own budget) and one reference on the slot; a session
pinning a block again extends its pin. A block not committed yet (the engine pins as soon as
its copies have landed, which may be just before their ``Commit`` reaches the daemon) waits
for its commit up to ``pin_pending_s``, then counts as missed.

Pins outlive the session that made them: an agent's engine may restart between its calls and
find its context still there. A session that ended pins nothing more, so its pins count
against nobody's budget from then on; they lapse at their deadline as any other.

Deadlines run on the clock the sessions use; ``sweep`` (called by the daemon's reaper) ends
the pins that lapsed, from a heap of deadlines, so a sweep costs only what it ends.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.service.tunables import TUNABLES
from kvtier.tiers.host.tier import HostTier


class PinResult(NamedTuple):
    pinned: int
    """Pins taken or extended (a block still being written waits for its commit)."""
    refused: int
    """Pins beyond the session's budget."""


@dataclass(slots=True)
class _Pin:
    """One pinned block: its host slot (None until committed) and each pinning session's
    deadline."""

    slot: int | None
    until: dict[str, float] = field(default_factory=dict)


class LayoutPins:
    """The pins of one layout's host tier."""

    def __init__(self, host: HostTier, budget: int, clock: Callable[[], float] = time.monotonic):
        self.host = host
        self.budget = budget
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[bytes, _Pin] = {}
        self._per_session: Counter[str] = Counter()
        self._deadlines: list[tuple[float, bytes, str]] = []  # heap; stale entries skipped
        self._pending: dict[bytes, float] = {}  # block not committed yet -> when to give up
        self.pinned_blocks = 0
        """Host slots pins hold now."""
        self.refused = 0
        self.missed = 0
        """Pins of blocks never found committed in the host tier (evicted, on disk only, or
        never stored)."""

    def pin(self, session_id: str, hashes: Sequence[bytes], seconds: float) -> PinResult:
        """Pins ``hashes`` for ``session_id`` until ``seconds`` from now."""
        now = self._clock()
        until = now + seconds
        pinned = refused = 0
        new: list[bytes] = []
        with self._lock:
            for h in dict.fromkeys(hashes):
                pin = self._pins.get(h)
                if pin is not None and session_id in pin.until:
                    if until > pin.until[session_id]:
                        pin.until[session_id] = until
                        heapq.heappush(self._deadlines, (until, h, session_id))
                    pinned += 1
                    continue
                if self._per_session[session_id] >= self.budget:
                    refused += 1
                    continue
                if pin is None:
                    pin = self._pins[h] = _Pin(None)
                    self._pending[h] = now + TUNABLES.pin_pending_s
                    new.append(h)
                pin.until[session_id] = until
                self._per_session[session_id] += 1
                heapq.heappush(self._deadlines, (until, h, session_id))
                pinned += 1
            self.refused += refused
            if new:
                self._resolve(new)
        return PinResult(pinned, refused)

    def committed(self) -> None:
        """Blocks were committed: pins waiting for them take their slots."""
        with self._lock:
            if self._pending:
                self._resolve(list(self._pending))

    def sweep(self) -> int:
        """Ends lapsed pins and gives up pins whose block never came; returns slots freed."""
        now = self._clock()
        freed: list[int] = []
        with self._lock:
            if self._pending:
                self._resolve(list(self._pending))
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                until, h, session_id = heapq.heappop(heap)
                pin = self._pins.get(h)
                if pin is None or pin.until.get(session_id) != until:
                    continue  # extended since, or given up
                del pin.until[session_id]
                self._uncount(session_id)
                if not pin.until:
                    self._drop(h, pin, freed)
            for h, give_up in list(self._pending.items()):
                if give_up <= now:
                    pin = self._pins[h]
                    for session_id in pin.until:
                        self._uncount(session_id)
                    self._drop(h, pin, freed)
            self.pinned_blocks -= len(freed)
        if freed:
            self.host.release(freed)
        return len(freed)

    def held_by(self, session_id: str) -> int:
        """Pins ``session_id`` holds (against its budget)."""
        with self._lock:
            return self._per_session[session_id]

    # ---- internals (with the lock held) ----

    def _resolve(self, hashes: list[bytes]) -> None:
        """Pins the host slots of those of ``hashes`` (pending) that are committed now."""
        ready = [h for h in hashes if self.host.contains(h)]
        if not ready:
            return
        found = self.host.lookup_in_memory(ready, hold=True)
        if found is None:  # one was evicted meanwhile: take them one by one
            resident = []
            for h in ready:
                one = self.host.lookup_in_memory([h], hold=True)
                resident += one[1] if one is not None else []
        else:
            resident = found[1]
        for h, slot in resident:
            self._pins[h].slot = slot
            del self._pending[h]
        self.pinned_blocks += len(resident)

    def _uncount(self, session_id: str) -> None:
        self._per_session[session_id] -= 1
        if not self._per_session[session_id]:
            del self._per_session[session_id]

    def _drop(self, h: bytes, pin: _Pin, freed: list[int]) -> None:
        del self._pins[h]
        if pin.slot is None:
            del self._pending[h]
            self.missed += 1
        else:
            freed.append(pin.slot)
