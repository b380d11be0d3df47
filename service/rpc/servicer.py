"""The gRPC face of the daemon: messages in, plain calls to ``Daemon``, messages out.

Refusals become status codes: a malformed argument ``INVALID_ARGUMENT``, too many hashes or
slots ``OUT_OF_RANGE``, an unknown session ``NOT_FOUND``, a slot or session the caller does not
hold ``PERMISSION_DENIED``, a layout the daemon cannot take ``FAILED_PRECONDITION``, a full
daemon (sessions, watchers, shared memory, a too-large request) ``RESOURCE_EXHAUSTED``, a call
that arrived after its own ``Cancel`` ``CANCELLED``.

The event loop runs only what the host tier's memory answers: a small lookup whose every hash
is in the host tier, and small stores of a layout with no tier below. Anything that may read
the disk or wait on the network (a lookup that must ask the disk or the remote store, a
reserve that asks the disk index, a commit that queues writes below, an acquire that may
promote), and any large batch, runs on worker threads, so a slow disk or remote store never
holds up another client's calls or keep-alives. Lookups that ask the tiers below have threads
of their own: a remote store that answers slowly holds them for up to its lookup timeout, and
must not hold up the slot operations behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.proto.contract import HASH_BYTES, pid_namespace
from kvtier.service.daemon import Daemon
from kvtier.service.events import EventHub
from kvtier.service.rpc import slot_ops, watch
from kvtier.service.rpc.calls import REFUSALS, log_source, session_peer, status_of, unary
from kvtier.service.rpc.handlers import Refused
from kvtier.service.rpc.wire import RequestError, check_hash, check_slots, split_hashes
from kvtier.service.session_errors import OwnershipError, SessionError
from kvtier.service.stats.metrics import Metrics
from kvtier.service.tunables import TUNABLES
from kvtier.tiers.ratelog import RateLimitedLog

log = logging.getLogger(__name__)


_TIER_FIELDS = frozenset(pb.TierStats.DESCRIPTOR.fields_by_name) - {"other"}


def _tier_stats(counters: dict) -> pb.TierStats:
    """Known counters into their fields, any newer ones into ``other``."""
    known = {k: v for k, v in counters.items() if k in _TIER_FIELDS}
    other = {k: v for k, v in counters.items() if k not in _TIER_FIELDS}
    return pb.TierStats(**known, other=other)


class KvTierServicer(pb_grpc.KvTierServicer):
    """Translates ``kvtier.v1`` calls into ``Daemon`` operations."""

    def __init__(
        self,
        daemon: Daemon,
        events: EventHub,
        metrics: Metrics,
        stopping: asyncio.Event,
        client_pid: Callable[[str], int | None] = lambda _peer: None,
    ):
        self.daemon = daemon
        self.client_pid = client_pid
        """gRPC peer -> the pid the kernel gave for that connection (the unix socket's relay)."""
        self.events = events
        self.metrics = metrics
        self.stopping = stopping
        self.max = daemon.config.max_hashes
        self._pool = ThreadPoolExecutor(TUNABLES.rpc_workers, thread_name_prefix="kvtier-rpc")
        self._lookups = ThreadPoolExecutor(
            TUNABLES.lookup_workers, thread_name_prefix="kvtier-lookup"
        )
        self._limiter = RateLimitedLog(log, interval_s=TUNABLES.grpc_log_interval_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._lookups.shutdown(wait=True)

    def refused(self, context: grpc.aio.ServicerContext, exc: BaseException, message: str) -> None:
        """Logs a malformed or oversized request once per peer and kind (others are normal)."""
        if isinstance(exc, RequestError) and exc.kind:
            peer = context.peer() or "?"
            self._limiter.warning(
                f"{log_source(peer)}/{exc.kind}", "refused %s from %s: %s", exc.kind, peer, message
            )

    def _hashes(self, request) -> list[bytes]:
        """The request's packed hashes, unpacked (bounded): called where the call runs, so a
        large batch is unpacked on a worker thread and not on the event loop."""
        return split_hashes(request.hashes, self.max)

    async def _run(
        self,
        fn: Callable[[], object],
        heavy: bool = True,
        pool: ThreadPoolExecutor | None = None,
    ) -> object:
        if not heavy:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, fn)

    # ---- sessions ----

    @unary
    async def Open(self, request: pb.OpenRequest, context) -> pb.OpenResponse:
        # The kernel's pid, in this namespace, over the client's word where the relay has it:
        # it also lets a client in another pid namespace be found gone.
        known = self.client_pid(context.peer() or "")
        pid, pid_ns = (
            (known, pid_namespace())
            if known is not None
            else (request.client_pid, request.client_pid_ns)
        )
        opened = await self._run(
            functools.partial(
                self.daemon.open,
                request.client_name,
                request.layout_signature,
                request.block_bytes,
                request.block_tokens,
                request.protocol_version,
                peer=session_peer(context),
                client_pid=pid,
                client_pid_ns=pid_ns,
                engine_group=request.engine_group[:128],
                lost_sessions=list(request.lost_sessions),
                layout_description=request.layout_description,
            )
        )
        arena = opened.store.arena
        return pb.OpenResponse(
            session_id=opened.session.session_id,
            daemon_id=self.daemon.daemon_id,
            arena_path=str(arena.path),
            arena_bytes=arena.size,
            num_slots=opened.store.num_slots,
            slot_bytes=opened.store.block_bytes,
            lease_ms=int(self.daemon.config.lease_s * 1000),
            max_hashes=self.max,
            max_reserved=opened.max_reserved,
            max_acquired=opened.max_acquired,
            lookup_hold_ms=int(self.daemon.config.lookup_hold_s * 1000),
            slot_lookups=True,
            reserve_ahead=opened.reserve_ahead,
        )

    @unary
    async def Close(self, request: pb.SessionRequest, context) -> pb.CloseResponse:
        left = self.daemon.close(request.session_id, session_peer(context))
        return pb.CloseResponse(aborted=len(left.reserved), released=len(left.acquired))

    async def KeepAlive(self, request: pb.SessionRequest, context) -> AsyncIterator:
        if isinstance(request, Refused):
            await context.abort(request.code, request.message)
        session_id = request.session_id
        try:
            self.daemon.attach(session_id, session_peer(context))
        except (SessionError, OwnershipError) as exc:
            await context.abort(*status_of(exc))
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

    @unary
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        return await self.lookup(request, session_peer(context))

    async def lookup(self, request: pb.LookupRequest, peer: str) -> pb.LookupResponse:
        probed = request.probed_host if request.HasField("probed_host") else None
        hits = None
        if not _heavy(request.hashes):
            hits = self.daemon.lookup(request.session_id, self._hashes(request), peer, True, probed)
        if hits is None:
            hits = await self._run(
                lambda: self.daemon.lookup(
                    request.session_id, self._hashes(request), peer, probed_host=probed
                ),
                pool=self._lookups,
            )
        return pb.LookupResponse(host=hits.host, disk=hits.disk, remote=hits.remote)

    @unary
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        return await self.reserve(request, session_peer(context))

    @unary
    async def Commit(self, request: pb.SlotsRequest, context) -> pb.SlotsResponse:
        return await self.commit(request, session_peer(context))

    @unary
    async def Abort(self, request: pb.SlotsRequest, context) -> pb.SlotsResponse:
        return await self.abort(request, session_peer(context))

    @unary
    async def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        return await self.acquire(request, session_peer(context))

    @unary
    async def Release(self, request: pb.SlotsRequest, context) -> pb.SlotsResponse:
        return await self.release(request, session_peer(context))

    @unary
    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        return await self.cancel(request, session_peer(context))

    async def SlotOps(self, request_iterator: AsyncIterator, context) -> AsyncIterator:
        async for results in slot_ops.serve(self, request_iterator, context):
            yield results

    # ---- slot operations, as a unary call or a ``SlotOps`` stream runs them ----

    async def reserve(self, request: pb.ReserveRequest, peer: str) -> pb.ReserveResponse:
        below = self.daemon.below_host(request.session_id, peer)
        slots = await self._run(
            lambda: self.daemon.reserve(
                request.session_id,
                self._hashes(request),
                list(request.metas),
                request.call_id,
                peer,
                request.unnamed,
            ),
            heavy=below or _heavy(request.hashes) or request.unnamed > TUNABLES.inline_batch,
        )
        return pb.ReserveResponse(slots=slots)

    async def commit(self, request: pb.SlotsRequest, peer: str) -> pb.SlotsResponse:
        slots = self._slots(request)
        not_stored = await self._run(
            lambda: self.daemon.commit(
                request.session_id, slots, peer, self._hashes(request), list(request.metas)
            ),
            heavy=len(slots) > TUNABLES.inline_batch
            or self.daemon.below_host(request.session_id, peer),
        )
        return pb.SlotsResponse(count=len(slots), not_stored=not_stored)

    async def abort(self, request: pb.SlotsRequest, peer: str) -> pb.SlotsResponse:
        slots = self._slots(request)
        self.daemon.abort(request.session_id, slots, peer)
        return pb.SlotsResponse(count=len(slots))

    async def acquire(self, request: pb.AcquireRequest, peer: str) -> pb.AcquireResponse:
        # Host hits alone are answered on the event loop: a hand-off to a worker thread and
        # back costs more than the pins (about 0.2 ms of a 0.5 ms round trip on 2 cores).
        found = None
        if not _heavy(request.hashes):
            found = self.daemon.acquire(
                request.session_id, self._hashes(request), request.call_id, peer, True
            )
        if found is None:
            found = await self._run(
                lambda: self.daemon.acquire(
                    request.session_id, self._hashes(request), request.call_id, peer
                )
            )
        slots, sources = found
        return pb.AcquireResponse(
            slots=slots, host=sources.host, disk=sources.disk, remote=sources.remote
        )

    async def release(self, request: pb.SlotsRequest, peer: str) -> pb.SlotsResponse:
        slots = self._slots(request)
        self.daemon.release(request.session_id, slots, peer)
        return pb.SlotsResponse(count=len(slots))

    async def cancel(self, request: pb.CancelRequest, peer: str) -> pb.CancelResponse:
        returned = self.daemon.cancel(request.session_id, request.call_id, peer)
        return pb.CancelResponse(returned=returned)

    @unary
    async def Pin(self, request: pb.PinRequest, context) -> pb.PinResponse:
        pin = functools.partial(self.daemon.pin, request.session_id, peer=session_peer(context))
        heavy = _heavy(request.hashes)
        result = await self._run(lambda: pin(self._hashes(request), request.seconds), heavy)
        return pb.PinResponse(pinned=result.pinned, refused=result.refused)

    # ---- blocks as bytes ----

    @unary
    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context) -> pb.PutResponse:
        response = pb.PutResponse()
        session_id = None
        peer = session_peer(context)
        async for message in request_iterator:
            if isinstance(message, Refused):
                raise RequestError(message.code, message.message, message.kind)
            session_id = session_id or message.session_id
            block_hash = check_hash(message.hash)
            result = await self._run(
                functools.partial(
                    self.daemon.put, session_id, block_hash, message.meta, message.data, peer
                )
            )
            if result > 0:
                response.stored += 1
            elif result == pb.ALREADY_STORED:
                response.already_stored += 1
            else:
                response.no_space += 1
        return response

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.GetResponse]:
        peer = session_peer(context)
        try:
            if isinstance(request, Refused):
                raise RequestError(request.code, request.message, request.kind)
            hashes = split_hashes(request.hashes, self.max)
            self.daemon.sessions.get(request.session_id, peer)
        except REFUSALS as exc:
            code, message = status_of(exc)
            self.refused(context, exc, message)
            await context.abort(code, message)
        for i in range(0, len(hashes), TUNABLES.get_chunk_blocks):
            chunk = hashes[i : i + TUNABLES.get_chunk_blocks]
            try:
                blocks = await self._run(
                    functools.partial(self.daemon.get, request.session_id, chunk, peer)
                )
            except REFUSALS as exc:
                await context.abort(*status_of(exc))
            for block_hash, data in zip(chunk, blocks, strict=False):
                yield pb.GetResponse(hash=block_hash, data=data)
            if len(blocks) < len(chunk):
                return

    # ---- statistics and events ----

    @unary
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = self.daemon.stats()
        return pb.StatsResponse(
            tiers=[_tier_stats(t) for t in stats.pop("tiers")],
            layouts=[pb.LayoutStats(**layout) for layout in stats.pop("layouts")],
            layout_blocks=[pb.LayoutBlocks(**layout) for layout in stats.pop("layout_blocks")],
            **stats,
        )

    async def WatchEvents(self, request: pb.WatchRequest, context) -> AsyncIterator:
        try:
            if isinstance(request, Refused):
                raise RequestError(request.code, request.message, request.kind)
            layout = bytes(request.layout_signature) or None
            if layout is not None and len(layout) != 16:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "layout_signature must be 16 bytes"
                )
            subscription = self.events.subscribe(layout)
        except REFUSALS as exc:
            await context.abort(*status_of(exc))
        try:
            if request.replay:
                stores = [s for s in self.daemon.store.layouts() if layout in (None, s.signature)]
                async for batch in watch.replay(stores, subscription, self._run):
                    yield batch
            async for batch in watch.live(subscription, context, self._limiter):
                yield batch
        finally:
            self.events.unsubscribe(subscription)

    def _slots(self, request: pb.SlotsRequest) -> list[int]:
        return check_slots(request.slots, self._max_slots(), self.max)

    def _max_slots(self) -> int:
        return max((s.num_slots for s in self.daemon.store.layouts()), default=0)


def _heavy(packed_hashes: bytes) -> bool:
    """Whether a call naming these hashes runs on a worker thread (see ``inline_batch``)."""
    return len(packed_hashes) > TUNABLES.inline_batch * HASH_BYTES
