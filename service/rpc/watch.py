"""The two halves of a ``WatchEvents`` stream: a replay of what the tiers hold, then the live
events of the watcher's subscription.

A watcher that falls behind loses events in the hub (``events``); its stream is then ended with
``ABORTED`` (details starting ``contract.EVENTS_LOST``) rather than go on past the hole, and the
watcher watches again with a replay.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import EVENTS_LOST
from kvtier.service.events import STORED, BlockEvent, Subscription
from kvtier.service.layout_store import LayoutStore
from kvtier.service.rpc.calls import log_source
from kvtier.service.tunables import TUNABLES
from kvtier.tiers.ratelog import RateLimitedLog

Run = Callable[[Callable[[], object]], Awaitable[object]]
"""Runs a blocking call on a worker thread."""


async def replay(
    stores: Sequence[LayoutStore], subscription: Subscription, run: Run
) -> AsyncIterator[pb.BlockEvents]:
    """Announces what the tiers of ``stores`` hold now, in batches; the last says
    ``replay_done``.

    The caller subscribed first, so a block stored or removed meanwhile is also in its live
    queue: a router may see a block announced twice, never miss one. A watcher that lost live
    events meanwhile gets no more of the replay (``live`` tells it why).
    """
    for store in stores:
        after: bytes | None = None
        while not subscription.lost:
            found = await run(functools.partial(store.snapshot, after, TUNABLES.watch_batch))
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
    if not subscription.lost:
        yield pb.BlockEvents(replay_done=True)


async def live(
    subscription: Subscription, context: grpc.aio.ServicerContext, limiter: RateLimitedLog
) -> AsyncIterator[pb.BlockEvents]:
    """The subscription's events in batches, until the hub closes; ends the call with
    ``ABORTED`` once the watcher has lost events."""
    queue = subscription.queue
    while True:
        if subscription.lost:
            await _lost(subscription, context, limiter)
        event = await queue.get()
        batch = []
        while event is not None:
            batch.append(_message(event))
            if len(batch) >= TUNABLES.watch_batch or queue.empty():
                break
            event = queue.get_nowait()
        if batch:
            yield pb.BlockEvents(events=batch)
        if event is None:
            return


async def _lost(
    subscription: Subscription, context: grpc.aio.ServicerContext, limiter: RateLimitedLog
) -> None:
    peer = context.peer() or "?"
    size = subscription.queue.maxsize
    limiter.warning(
        f"{log_source(peer)}/events-lost",
        "watcher %s fell behind and lost %d events (its queue holds %d); its stream ends so "
        "that it watches again with a replay",
        peer,
        subscription.lost,
        size,
    )
    await context.abort(
        grpc.StatusCode.ABORTED,
        f"{EVENTS_LOST}: this watcher fell behind and lost {subscription.lost} events (its "
        f"queue holds {size}); watch again with replay",
    )


def _message(event: BlockEvent) -> pb.BlockEvent:
    return pb.BlockEvent(
        kind=pb.BlockEvent.STORED if event.kind == STORED else pb.BlockEvent.REMOVED,
        tier=event.tier,
        hash=event.hash,
        meta=event.meta,
        layout_signature=event.layout,
    )
