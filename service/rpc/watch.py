"""``WatchEvents``: the block events a router follows, optionally after a replay of what the
tiers hold. A watcher that falls behind and loses events has its stream ended with
``ABORTED`` (``EVENTS_LOST``) and watches again with a replay: a stream never has holes.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import EVENTS_LOST
from kvtier.service.events import STORED, BlockEvent, EventHub, Subscription
from kvtier.service.layout_store import LayoutStore
from kvtier.service.rpc.calls import REFUSALS, log_source, status_of
from kvtier.service.rpc.handlers import Refused
from kvtier.service.rpc.wire import RequestError
from kvtier.tiers.ratelog import RateLimitedLog

WATCH_BATCH = 1024
"""Most events one message carries (live or replayed)."""


class EventStreams:
    def __init__(
        self,
        events: EventHub,
        layouts: Callable[[], Iterable[LayoutStore]],
        run: Callable[[Callable[[], object]], Awaitable[object]],
        limiter: RateLimitedLog,
    ):
        """``layouts()`` lists the daemon's layouts now; ``run(fn)`` runs ``fn`` off the
        event loop (a replay reads the disk index)."""
        self._events = events
        self._layouts = layouts
        self._run = run
        self._limiter = limiter

    async def stream(self, request: pb.WatchRequest, context) -> AsyncIterator[pb.BlockEvents]:
        """One ``WatchEvents`` stream: the replay if asked, then live events in batches."""
        try:
            if isinstance(request, Refused):
                raise RequestError(request.code, request.message, request.kind)
            layout = bytes(request.layout_signature) or None
            if layout is not None and len(layout) != 16:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "layout_signature must be 16 bytes"
                )
            subscription = self._events.subscribe(layout)
        except REFUSALS as exc:
            await context.abort(*status_of(exc))
        try:
            if request.replay:
                async for batch in self._replay(layout):
                    if subscription.lost:
                        break
                    yield batch
            queue = subscription.queue
            while True:
                if subscription.lost:
                    await self._events_lost(context, subscription)
                event = await queue.get()
                batch = []
                while event is not None:
                    batch.append(_event(event))
                    if len(batch) >= WATCH_BATCH or queue.empty():
                        break
                    event = queue.get_nowait()
                if batch:
                    yield pb.BlockEvents(events=batch)
                if event is None:
                    return
        finally:
            self._events.unsubscribe(subscription)

    async def _events_lost(self, context, subscription: Subscription) -> None:
        """Ends the stream of a watcher that lost events: it watches again with a replay."""
        peer = context.peer() or "?"
        self._limiter.warning(
            f"{log_source(peer)}/events-lost",
            "watcher %s fell behind and lost %d events (its queue holds %d); its stream ends "
            "so that it watches again with a replay",
            peer,
            subscription.lost,
            subscription.queue.maxsize,
        )
        await context.abort(
            grpc.StatusCode.ABORTED,
            f"{EVENTS_LOST}: this watcher fell behind and lost {subscription.lost} events "
            f"(its queue holds {subscription.queue.maxsize}); watch again with replay",
        )

    async def _replay(self, layout: bytes | None) -> AsyncIterator[pb.BlockEvents]:
        """Announces what the tiers hold now, in batches; the last says ``replay_done``.

        The caller subscribed first, so a block stored or removed meanwhile is also in its
        live queue: a router may see a block announced twice, never miss one.
        """
        stores = [s for s in self._layouts() if layout in (None, s.signature)]
        for store in stores:
            after: bytes | None = None
            while True:
                found = await self._run(functools.partial(store.snapshot, after, WATCH_BATCH))
                if not found:
                    break
                yield pb.BlockEvents(
                    events=[
                        pb.BlockEvent(
                            kind=pb.BlockEvent.STORED,
                            tier=tier,
                            hash=block_hash,
                            meta=meta,
                            layout_signature=store.signature,
                        )
                        for tier, block_hash, meta in found
                    ]
                )
                disk = [h for tier, h, _ in found if tier != "host"]
                if not disk:
                    break
                after = disk[-1]
        yield pb.BlockEvents(replay_done=True)


def _event(event: BlockEvent) -> pb.BlockEvent:
    return pb.BlockEvent(
        kind=pb.BlockEvent.STORED if event.kind == STORED else pb.BlockEvent.REMOVED,
        tier=event.tier,
        hash=event.hash,
        meta=event.meta,
        layout_signature=event.layout,
    )
