"""Fan-out of block stored/removed events to ``WatchEvents`` subscribers.

The tiers report events from whatever thread changed them (the host tier under its lock, the
disk tier from its writer thread); ``emit`` only appends them to a buffer and wakes the event
loop once per burst, so the tiers pay a deque append per event however many routers listen.
The loop hands each burst to every subscriber whose layout filter matches, into a bounded
queue: a router too slow to keep up loses events (counted in ``dropped``) rather than holding
memory or slowing the tiers. From its first lost event on, a subscriber is sent nothing more
(``lost`` counts what it missed), so that its stream never goes on past a hole: the servicer
ends the stream, and the watcher watches again with a replay. ``None`` in a queue means the
hub closed. At most ``max_subscribers`` watch at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass

STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    kind: str
    tier: str
    hash: bytes
    meta: bytes
    layout: bytes


class TooManyWatchers(RuntimeError):
    """Every watcher slot is taken."""


class Subscription:
    """One watcher's bounded queue, the layout it follows (None: every layout), and how many
    events it lost (from the first one lost on, it is sent none)."""

    __slots__ = ("layout", "lost", "queue")

    def __init__(self, layout: bytes | None, size: int):
        self.layout = layout
        self.queue: asyncio.Queue[BlockEvent | None] = asyncio.Queue(size)
        self.lost = 0


class EventHub:
    """Thread-safe producer side, asyncio consumer side."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        queue_size: int = 8192,
        max_subscribers: int = 64,
    ):
        self._loop = loop
        self._queue_size = queue_size
        self.max_subscribers = max_subscribers
        self._subscribers: set[Subscription] = set()
        self._pending: deque[BlockEvent] = deque()
        self._pending_lock = threading.Lock()
        self._wake_scheduled = False
        self._closed = False
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._subscribers)

    def emit(self, kind: str, tier: str, block_hash: bytes, meta: bytes, layout: bytes) -> None:
        """Called by the tiers from any thread; never blocks, never calls back into them."""
        if self._closed or not self._subscribers:
            return
        with self._pending_lock:
            self._pending.append(BlockEvent(kind, tier, block_hash, meta, layout))
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._loop.call_soon_threadsafe(self._deliver)

    def subscribe(self, layout: bytes | None) -> Subscription:
        """A new watcher (loop thread only); ``TooManyWatchers`` past the cap."""
        if len(self._subscribers) >= self.max_subscribers:
            raise TooManyWatchers(
                f"{len(self._subscribers)} watchers already follow this daemon (max_watchers)"
            )
        subscription = Subscription(layout, self._queue_size)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def close(self) -> None:
        """Stops taking events and ends every subscriber's stream (loop thread only)."""
        self._closed = True
        for subscription in self._subscribers:
            queue = subscription.queue
            while queue.full():
                queue.get_nowait()
            queue.put_nowait(None)

    def _deliver(self) -> None:
        with self._pending_lock:
            burst, self._pending = self._pending, deque()
            self._wake_scheduled = False
        for subscription in self._subscribers:
            queue, layout = subscription.queue, subscription.layout
            for event in burst:
                if layout is not None and event.layout != layout:
                    continue
                if not subscription.lost:
                    try:
                        queue.put_nowait(event)
                        continue
                    except asyncio.QueueFull:
                        pass
                subscription.lost += 1
                self.dropped += 1
