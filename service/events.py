"""Fan-out of block stored/removed events to ``WatchEvents`` subscribers.

The tiers report events from whatever thread changed them (the host tier under its lock, the
disk tier from its writer thread); ``emit`` only hands them to the event loop. Each subscriber
has a bounded queue: a router too slow to keep up loses events (counted in ``dropped``) rather
than holding memory or slowing the tiers; ``None`` in a queue means the hub closed. Parent
hashes come from ``Reserve``/``Put`` callers that sent them and are kept in a bounded map.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    kind: str
    tier: str
    hash: bytes
    parent: bytes


class EventHub:
    """Thread-safe producer side, asyncio consumer side, one bounded queue per subscriber."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, queue_size: int = 8192, max_parents: int = 1 << 20
    ):
        self._loop = loop
        self._queue_size = queue_size
        self._max_parents = max_parents
        self._parents: OrderedDict[bytes, bytes] = OrderedDict()
        self._subscribers: set[asyncio.Queue[BlockEvent | None]] = set()
        self._closed = False
        self.dropped = 0

    def note_parents(self, hashes: Sequence[bytes], parents: Sequence[bytes]) -> None:
        """Remembers each hash's parent for the events that name it (loop thread only)."""
        for h, p in zip(hashes, parents, strict=True):
            self._parents[h] = p
            self._parents.move_to_end(h)
        while len(self._parents) > self._max_parents:
            self._parents.popitem(last=False)

    def emit(self, kind: str, tier: str, block_hash: bytes) -> None:
        """Called by the tiers from any thread; never blocks, never calls back into them."""
        if self._closed or not self._subscribers:
            return
        self._loop.call_soon_threadsafe(self._deliver, kind, tier, block_hash)

    def subscribe(self) -> asyncio.Queue[BlockEvent | None]:
        queue: asyncio.Queue[BlockEvent | None] = asyncio.Queue(self._queue_size)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[BlockEvent | None]) -> None:
        self._subscribers.discard(queue)

    def close(self) -> None:
        """Stops taking events and ends every subscriber's stream (loop thread only)."""
        self._closed = True
        for queue in self._subscribers:
            while queue.full():
                queue.get_nowait()
            queue.put_nowait(None)

    def _deliver(self, kind: str, tier: str, block_hash: bytes) -> None:
        event = BlockEvent(kind, tier, block_hash, self._parents.get(block_hash, b""))
        for queue in self._subscribers:
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self.dropped += 1
