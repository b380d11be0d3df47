"""The gRPC face of the daemon: messages in, plain calls to ``Daemon``, messages out.

Refusals become status codes: a malformed argument ``INVALID_ARGUMENT``, too many hashes or
slots ``OUT_OF_RANGE``, an unknown session ``NOT_FOUND``, a slot the caller does not hold
``PERMISSION_DENIED``, a second layout ``FAILED_PRECONDITION``, a commit the disk tier could not
make durable ``UNAVAILABLE``. Calls that may touch the disk (commit, acquire, put, get) run on
worker threads; the rest are in-memory and answer straight from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.service.daemon import Daemon
from kvtier.service.events import STORED, EventHub
from kvtier.service.metrics import Metrics
from kvtier.service.sessions import OwnershipError, SessionError
from kvtier.service.store import LayoutMismatch, StoreUnavailable
from kvtier.service.wire import RequestError, check_hash, check_slots, split_hashes

GET_CHUNK = 8
"""Blocks a ``Get`` holds at once: bounds the daemon's memory per stream."""
WATCH_BATCH = 1024


_TIER_FIELDS = frozenset(pb.TierStats.DESCRIPTOR.fields_by_name) - {"other"}


def _tier_stats(counters: dict) -> pb.TierStats:
    """Known counters into their fields, any newer ones into ``other``."""
    known = {k: v for k, v in counters.items() if k in _TIER_FIELDS}
    other = {k: v for k, v in counters.items() if k not in _TIER_FIELDS}
    return pb.TierStats(**known, other=other)


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    code = {
        SessionError: grpc.StatusCode.NOT_FOUND,
        OwnershipError: grpc.StatusCode.PERMISSION_DENIED,
        LayoutMismatch: grpc.StatusCode.FAILED_PRECONDITION,
        StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    }[type(exc)]
    return code, str(exc)


_REFUSALS = (RequestError, SessionError, OwnershipError, LayoutMismatch, StoreUnavailable)

Handler = Callable[["KvTierServicer", object, grpc.aio.ServicerContext], Awaitable[object]]


def _unary(method: Handler) -> Handler:
    """Times the call and turns refusals into status codes."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: KvTierServicer, request: object, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except _REFUSALS as exc:
            code, message = _status(exc)
            await context.abort(code, message)
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            self.metrics.observe(name, code.name, time.perf_counter() - start)

    return wrapper


class KvTierServicer(pb_grpc.KvTierServicer):
    """Translates ``kvtier.v1`` calls into ``Daemon`` operations."""

    def __init__(self, daemon: Daemon, events: EventHub, metrics: Metrics, stopping: asyncio.Event):
        self.daemon = daemon
        self.events = events
        self.metrics = metrics
        self.stopping = stopping
        self.max = daemon.config.max_hashes

    # ---- sessions ----

    @_unary
    async def Open(self, request: pb.OpenRequest, context) -> pb.OpenResponse:
        opened = self.daemon.open(
            request.client_name,
            request.layout_signature,
            request.block_bytes,
            request.block_tokens,
            request.protocol_version,
            request.client_pid,
            request.client_pid_ns,
        )
        arena = self.daemon.store.arena
        return pb.OpenResponse(
            session_id=opened.session.session_id,
            daemon_id=self.daemon.daemon_id,
            arena_path=str(arena.path),
            arena_bytes=arena.size,
            num_slots=opened.num_slots,
            slot_bytes=opened.slot_bytes,
            lease_ms=int(self.daemon.config.lease_s * 1000),
            max_hashes=self.max,
        )

    @_unary
    async def Close(self, request: pb.SessionRequest, context) -> pb.CloseResponse:
        left = self.daemon.close(request.session_id)
        return pb.CloseResponse(aborted=len(left.reserved), released=len(left.acquired))

    async def KeepAlive(self, request: pb.SessionRequest, context) -> AsyncIterator:
        session_id = request.session_id
        try:
            self.daemon.attach(session_id)
        except SessionError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        lease_ms = int(self.daemon.config.lease_s * 1000)
        interval = self.daemon.config.lease_s / 3
        try:
            while not self.stopping.is_set():
                yield pb.KeepAliveResponse(lease_ms=lease_ms)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), interval)
        finally:
            # Runs when the client goes away too (the call is cancelled): its lifeline is gone.
            self.daemon.detach(session_id)

    # ---- blocks over the arena ----

    @_unary
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        hits = self.daemon.lookup(request.session_id, split_hashes(request.hashes, self.max))
        return pb.LookupResponse(host=hits.host, disk=hits.disk)

    @_unary
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        hashes = split_hashes(request.hashes, self.max)
        if request.parent_hashes:
            parents = split_hashes(request.parent_hashes, self.max, "parent_hashes")
            if len(parents) != len(hashes):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(parents)} parent hashes for {len(hashes)} hashes",
                )
            self.events.note_parents(hashes, parents)
        return pb.ReserveResponse(slots=self.daemon.reserve(request.session_id, hashes))

    @_unary
    async def Commit(self, request: pb.SlotsRequest, context) -> pb.CommitResponse:
        slots = self._slots(request)
        if self.daemon.store.disk is None:  # nothing to wait for: answer from the loop
            durable = self.daemon.commit(request.session_id, slots)
        else:
            durable = await asyncio.to_thread(self.daemon.commit, request.session_id, slots)
        return pb.CommitResponse(count=len(slots), durable=durable)

    @_unary
    async def Abort(self, request: pb.SlotsRequest, context) -> pb.SlotsResponse:
        slots = self._slots(request)
        self.daemon.abort(request.session_id, slots)
        return pb.SlotsResponse(count=len(slots))

    @_unary
    async def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        hashes = split_hashes(request.hashes, self.max)
        slots = await asyncio.to_thread(self.daemon.acquire, request.session_id, hashes)
        return pb.AcquireResponse(slots=slots)

    @_unary
    async def Release(self, request: pb.SlotsRequest, context) -> pb.SlotsResponse:
        slots = self._slots(request)
        self.daemon.release(request.session_id, slots)
        return pb.SlotsResponse(count=len(slots))

    # ---- blocks as bytes ----

    @_unary
    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context) -> pb.PutResponse:
        response = pb.PutResponse()
        session_id = None
        async for message in request_iterator:
            session_id = session_id or message.session_id
            block_hash = check_hash(message.hash)
            if message.parent_hash:
                self.events.note_parents([block_hash], [check_hash(message.parent_hash, "parent")])
            result = await asyncio.to_thread(self.daemon.put, session_id, block_hash, message.data)
            if result > 0:
                response.stored += 1
            elif result == pb.ALREADY_STORED:
                response.already_stored += 1
            else:
                response.no_space += 1
        return response

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.GetResponse]:
        try:
            hashes = split_hashes(request.hashes, self.max)
            self.daemon.sessions.get(request.session_id)
        except _REFUSALS as exc:
            await context.abort(*_status(exc))
        for i in range(0, len(hashes), GET_CHUNK):
            chunk = hashes[i : i + GET_CHUNK]
            try:
                blocks = await asyncio.to_thread(self.daemon.get, request.session_id, chunk)
            except _REFUSALS as exc:
                await context.abort(*_status(exc))
            for block_hash, data in zip(chunk, blocks, strict=False):
                yield pb.GetResponse(hash=block_hash, data=data)
            if len(blocks) < len(chunk):
                return

    # ---- statistics and events ----

    @_unary
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = self.daemon.stats()
        return pb.StatsResponse(tiers=[_tier_stats(t) for t in stats.pop("tiers")], **stats)

    async def WatchEvents(self, request: pb.WatchRequest, context) -> AsyncIterator:
        queue = self.events.subscribe()
        try:
            while True:
                event = await queue.get()
                batch = []
                while event is not None:
                    batch.append(
                        pb.BlockEvent(
                            kind=pb.BlockEvent.STORED
                            if event.kind == STORED
                            else pb.BlockEvent.REMOVED,
                            tier=event.tier,
                            hash=event.hash,
                            parent_hash=event.parent,
                        )
                    )
                    if len(batch) >= WATCH_BATCH or queue.empty():
                        break
                    event = queue.get_nowait()
                if batch:
                    yield pb.BlockEvents(events=batch)
                if event is None:
                    return
        finally:
            self.events.unsubscribe(queue)

    def _slots(self, request: pb.SlotsRequest) -> list[int]:
        return check_slots(request.slots, self.daemon.store.num_slots, self.max)
