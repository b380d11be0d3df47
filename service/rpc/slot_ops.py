"""The daemon's end of a ``SlotOps`` stream: one session's slot operations (and lookups), in
batches.

Each operation runs through the servicer's own method for it (``reserve``, ``commit``, …), the
code its unary call runs, with the stream's peer: the same session checks (bound to the
connection that opened it), shares, holds, fence and refusals. A refused operation is answered
with the status its own call would have ended with; the stream goes on. The stream ends, with
a status, when a batch cannot be taken: undecodable or too large, more than ``MAX_SLOT_OPS``
operations, a first batch naming no live session of this connection, a later one naming
another session. It also ends when the daemon stops.

``SlotOpRunner`` is that per-operation part, shared with the slot channel (``slot_channel``):
it runs each operation at once, in the caller, as far as it goes without waiting (``eager``),
so an operation the host tier's memory answers costs no task and no turn of the event loop.
Operations start in the order they arrive (those answered at once finish in that order too)
and are answered as they finish, in batches. At most ``slot_ops_in_flight`` of a stream's are
running or waiting to be written: beyond that the daemon stops reading the stream, so a
client that sends without reading its answers is held by flow control, not by the daemon's
memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import MAX_SLOT_OPS
from kvtier.service.rpc.calls import REFUSALS, session_peer, status_of
from kvtier.service.rpc.eager import start_eagerly
from kvtier.service.rpc.handlers import Refused
from kvtier.service.rpc.wire import RequestError
from kvtier.service.tunables import TUNABLES

log = logging.getLogger(__name__)

_RESULT_FIELD = {
    "reserve": "reserve",
    "commit": "slots",
    "abort": "slots",
    "acquire": "acquire",
    "release": "slots",
    "cancel": "cancel",
    "lookup": "lookup",
}
"""Each operation's field in ``SlotOp`` -> the field of ``SlotResult`` its answer goes in."""


@dataclass(frozen=True, slots=True)
class _End:
    """The stream is over: normally (``refusal`` None) or with the refusal's status."""

    refusal: BaseException | None = None


def serve(servicer, requests: AsyncIterator, context) -> AsyncIterator[pb.SlotResultBatch]:
    """Answers a ``SlotOps`` stream (``servicer`` is the ``KvTierServicer``)."""
    return _Stream(servicer, context).answer(requests)


class _Stream:
    def __init__(self, servicer, context: grpc.aio.ServicerContext):
        self.servicer = servicer
        self.context = context
        self.out: asyncio.Queue = asyncio.Queue()
        self.ops = SlotOpRunner(servicer, context, self.out.put_nowait)
        self.room = asyncio.Semaphore(TUNABLES.slot_ops_in_flight)
        self.running: set[asyncio.Task] = set()

    async def answer(self, requests: AsyncIterator) -> AsyncIterator[pb.SlotResultBatch]:
        reader = asyncio.create_task(self._read(requests))
        stopping = asyncio.create_task(self._stop_with_daemon())
        try:
            while True:
                results, end = await self._next_results()
                if results:
                    yield pb.SlotResultBatch(results=results)
                    for _ in results:
                        self.room.release()
                if end is not None:
                    break
        finally:
            reader.cancel()
            stopping.cancel()
        if end.refusal is not None:
            await self.context.abort(*status_of(end.refusal))

    async def _next_results(self) -> tuple[list[pb.SlotResult], _End | None]:
        """The results ready now (waiting for one), up to one batch, and the end if it came."""
        item = await self.out.get()
        results = []
        while not isinstance(item, _End):
            results.append(item)
            if len(results) >= MAX_SLOT_OPS or self.out.empty():
                return results, None
            item = self.out.get_nowait()
        return results, item

    async def _read(self, requests: AsyncIterator) -> None:
        """Starts each batch's operations; ends the stream when the client ends its side (once
        every operation is answered) or sent a batch that cannot be taken."""
        end = _End(RequestError(grpc.StatusCode.UNKNOWN, "the daemon failed reading the stream"))
        try:
            async for batch in requests:
                self.ops.check(batch)
                for op in batch.ops:
                    await self.room.acquire()
                    task = self.ops.start(op)
                    if task is not None:
                        self.running.add(task)
                        task.add_done_callback(self.running.discard)
            if self.running:
                await asyncio.wait(list(self.running))
            end = _End()
        except REFUSALS as exc:
            self.servicer.refused(self.context, exc, status_of(exc)[1])
            end = _End(exc)
        finally:
            self.out.put_nowait(end)

    async def _stop_with_daemon(self) -> None:
        await self.servicer.stopping.wait()
        self.out.put_nowait(_End(RequestError(grpc.StatusCode.UNAVAILABLE, "daemon stopping")))


class SlotOpRunner:
    """Checks a session's batches and runs their operations, each as its unary call would,
    handing every result to ``emit`` as it finishes: one stream's or channel's."""

    def __init__(self, servicer, context, emit: Callable[[pb.SlotResult], None]):
        self.servicer = servicer
        self.context = context
        self.peer = session_peer(context)
        self.session = ""
        self._emit = emit

    def start(self, op: pb.SlotOp) -> asyncio.Task | None:
        """Runs ``op`` at once up to its first wait: None if it was answered there (most are:
        the host tier's memory answers them), else the task that answers it."""
        return start_eagerly(self._run(op))

    def check(self, batch: pb.SlotOpBatch | Refused) -> None:
        """Refuses a batch the stream cannot take (``RequestError`` or a session refusal)."""
        if isinstance(batch, Refused):
            raise RequestError(batch.code, batch.message, batch.kind)
        if len(batch.ops) > MAX_SLOT_OPS:
            raise RequestError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"{len(batch.ops)} operations in one batch, at most {MAX_SLOT_OPS}",
                "SlotOps-too-many",
            )
        if batch.session_id and not self.session:
            self.servicer.daemon.sessions.get(batch.session_id, self.peer)
            self.session = batch.session_id
        elif batch.session_id and batch.session_id != self.session:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED, "this stream serves another session"
            )
        if not self.session:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "a stream's first batch names its session"
            )

    async def _run(self, op: pb.SlotOp) -> None:
        """Runs one operation as its unary call would, and queues its result."""
        kind = op.WhichOneof("op")
        method = kind.capitalize() if kind else "SlotOps"
        result = pb.SlotResult(op_id=op.op_id)
        code = grpc.StatusCode.OK
        start = time.perf_counter()
        try:
            if kind is None:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "an operation names no kind")
            request = getattr(op, kind)
            if request.session_id not in ("", self.session):
                raise RequestError(
                    grpc.StatusCode.PERMISSION_DENIED, "this stream serves another session"
                )
            request.session_id = self.session
            answer = await getattr(self.servicer, kind)(request, self.peer)
            getattr(result, _RESULT_FIELD[kind]).CopyFrom(answer)
        except REFUSALS as exc:
            code, result.message = status_of(exc)
            self.servicer.refused(self.context, exc, result.message)
        except Exception:
            # Its unary call would end UNKNOWN (gRPC logs why): this operation alone does.
            log.exception("SlotOps %s failed", method)
            code, result.message = grpc.StatusCode.UNKNOWN, f"{method} failed in the daemon"
        finally:
            result.code = code.value[0]
            self.servicer.metrics.observe(method, code.name, time.perf_counter() - start)
            self._emit(result)
