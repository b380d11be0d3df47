"""The daemon client's slot operations: over the session's ``SlotOps`` stream, or unary.

Reserve, Commit, Abort, Acquire, Release and Cancel of the live session share one long-lived
stream: each operation carries an id, a writer gathers what callers on any thread queued into
one batch, and a reader hands each answer to the caller waiting for its id. An operation
answers as its unary call would: the reply, or a ``grpc.RpcError`` with the code and details
its call would have ended with, so the client's failure handling (breaker, repair, giving the
session up) is the same for both.

The stream serves one session. A call for the live session finds its stream open, or opens
it (ending the stream of an earlier session); a call for any other session goes unary. When
the stream breaks, every operation waiting on it fails with the stream's status, as a call
cut off that way would, and calls go unary until a new stream opens ``stream_retry_s`` later;
a daemon that has no ``SlotOps`` (a build from before it) ran none of the operations its stream
carried: each goes again as its own unary call, and that client calls unary for good.
A waiting caller keeps its deadline (``call``); an operation sent without waiting (``future``)
waits for its answer or for the stream's end, and ``LaterCalls.settle`` bounds how long
anything waits on it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from kvtier.connector.client.deadlines import Deadlines
from kvtier.connector.client.session import SessionKeeper
from kvtier.connector.client.slot_answers import (
    OP_FIELDS,
    OpFuture,
    PendingOp,
    PendingOps,
    StreamError,
)
from kvtier.connector.client.slot_channel import ChannelStream, connect
from kvtier.connector.tunables import TUNABLES
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class _Stream:
    """One open ``SlotOps`` stream, bound to ``session``."""

    def __init__(self, stub: pb_grpc.KvTierStub, session: str, metadata):
        self.session = session
        self.pending = PendingOps()
        self._stub = stub
        self._metadata = metadata
        self._closed = False
        self._queue: queue.SimpleQueue[pb.SlotOp | None] = queue.SimpleQueue()
        self._responses = stub.SlotOps(self._batches(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="kvtier-slot-ops", daemon=True)
        self._reader.start()

    def unimplemented(self) -> bool:
        """Whether the daemon has no ``SlotOps``."""
        broken = self.pending.broken
        return broken is not None and broken.code() == grpc.StatusCode.UNIMPLEMENTED

    def put(self, op_id: int, method: str, request, timeout: float) -> OpFuture | None:
        """Queues an operation; None if the stream is broken (the caller goes unary)."""
        future = self.pending.add(op_id, method, request, timeout)
        if future is not None:
            self._queue.put(pb.SlotOp(op_id=op_id, **{OP_FIELDS[method][0]: request}))
        return future

    def wait(self, future: OpFuture, timeout: float):
        """``future.result(timeout)``: the reader thread reads every answer."""
        return future.result(timeout)

    def close(self) -> None:
        """Ends the stream; what still waits on it fails as cancelled by the client."""
        self._closed = True
        self._queue.put(None)
        self._responses.cancel()

    def _batches(self) -> Iterator[pb.SlotOpBatch]:
        """What callers queued, one batch per wake-up; the first names the session."""
        session = self.session
        while True:
            op = self._queue.get()
            ops, size = [], 0
            while op is not None:
                ops.append(op)
                size += op.ByteSize()
                if len(ops) >= contract.MAX_SLOT_OPS or size >= contract.SLOT_BATCH_BYTES:
                    break
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
            if ops:
                yield pb.SlotOpBatch(session_id=session, ops=ops)
                session = ""
            if op is None:
                return

    def _read(self) -> None:
        try:
            for batch in self._responses:
                for result in batch.results:
                    self.pending.answer(result)
            error = StreamError(grpc.StatusCode.UNAVAILABLE, "SlotOps stream ended")
        except grpc.RpcError as exc:
            error = StreamError(exc.code(), exc.details() or "SlotOps stream broke")
        pending = self.pending.end(error)
        if self.unimplemented():
            for op in pending:
                self._send_unary(op)
            return
        if pending:
            log.debug("kvtier SlotOps stream broke (%s); %d operations fail", error, len(pending))
        for op in pending:
            op.future.finish(error=error, cancelled=self._closed)

    def _send_unary(self, op: PendingOp) -> None:
        """Sends an operation the daemon never ran as its own call; its answer is the op's."""
        call = getattr(self._stub, op.method).future(
            op.request, timeout=op.timeout, metadata=self._metadata
        )

        def answered(call: grpc.Future) -> None:
            if call.cancelled():
                op.future.finish(
                    error=StreamError(grpc.StatusCode.CANCELLED, f"{op.method} cancelled"),
                    cancelled=True,
                )
            elif call.exception() is not None:
                op.future.finish(error=call.exception())
            else:
                op.future.finish(call.result())

        call.add_done_callback(answered)


class SlotCalls:
    """Sends slot operations over the live session's stream (``streaming``) or unary.

    ``keeper.session`` is the live session: only its operations use the stream.
    """

    def __init__(
        self,
        stub: pb_grpc.KvTierStub,
        keeper: SessionKeeper,
        metadata,
        target: str,
        streaming: bool,
        channel: bool,
    ):
        """Operations go over the daemon's slot channel (``channel``) where it has one, else
        over a ``SlotOps`` stream (``streaming``), else each unary; a daemon on another host
        (``target`` not a unix socket) has neither."""
        self._stub = stub
        self._keeper = keeper
        self._metadata = metadata
        self.streaming = streaming and target.startswith("unix:")
        self._channel_path = (
            os.fspath(contract.slot_channel_path(target.removeprefix("unix:")))
            if channel and self.streaming
            else None
        )
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stream: _Stream | ChannelStream | None = None
        self._retry_at = 0.0
        self._deadlines = Deadlines()
        self.streamed = 0
        """Operations sent over a stream."""
        self.streams_opened = 0
        self.channels_opened = 0
        """Slot channels opened (each a stream the daemon's socket for them carries)."""
        self.fallbacks = 0
        """Operations sent unary because the stream was broken."""

    def call(self, method: str, request, timeout: float):
        """Sends one operation and waits up to ``timeout`` for its reply."""
        op_id = next(self._ids)
        stream, future = self._put(op_id, method, request, timeout)
        if future is None:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
        try:
            return stream.wait(future, timeout)
        except grpc.FutureTimeoutError:
            stream.pending.forget(op_id)
            raise StreamError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} missed its deadline"
            ) from None

    def future(self, method: str, request, timeout: float, polled: bool = False):
        """Sends one operation without waiting; ``timeout`` bounds a unary call, and over a
        stream only a ``polled`` operation's (one whose answer someone waits for)."""
        _, future = self._put(next(self._ids), method, request, timeout)
        if future is None:
            return getattr(self._stub, method).future(
                request, timeout=timeout, metadata=self._metadata
            )
        if polled:
            self._deadlines.watch(future, method, timeout)
        return future

    def ordered_before_next(self, future) -> bool:
        """Whether the next operation goes over the same open stream (or channel) as
        ``future``'s, behind it. The daemon starts a stream's operations in the order they
        came, and answers a Release, Abort or Cancel as it starts it: the next operation sees
        what such a one did without waiting for its answer."""
        stream = self._stream
        return (
            stream is not None
            and stream.pending.broken is None
            and getattr(future, "carrier", None) is stream.pending
        )

    def close(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
            self.streaming = False
        if stream is not None:
            stream.close()
        self._deadlines.close()

    def _put(
        self, op_id: int, method: str, request, timeout: float
    ) -> tuple[_Stream | ChannelStream | None, OpFuture | None]:
        if not self.streaming:
            return None, None
        stream = self._stream_for(request.session_id)
        if stream is None:
            return None, None
        future = stream.put(op_id, method, request, timeout)
        if future is None:
            self.fallbacks += 1
        else:
            self.streamed += 1
        return stream, future

    def _stream_for(self, session: str) -> _Stream | ChannelStream | None:
        """The live session's open stream (opened if needed); None: go unary."""
        if session != self._keeper.session:
            return None
        with self._lock:
            stream = self._stream
            if stream is not None and stream.session == session and stream.pending.broken is None:
                return stream
            if stream is not None and stream.unimplemented():
                self.streaming = False  # a daemon from before SlotOps: unary for good
                return None
            now = time.monotonic()
            broken = stream is not None and stream.pending.broken is not None
            if broken and stream.session == session:
                if not self._retry_at:
                    self._retry_at = now + TUNABLES.stream_retry_s
                if now < self._retry_at:
                    self.fallbacks += 1
                    return None
            if not self.streaming:
                return None
            self._retry_at = 0.0
            opened = self._stream = self._open(session)
        if stream is not None:
            stream.close()
        return opened

    def _open(self, session: str) -> _Stream | ChannelStream:
        """The slot channel where the daemon has one, else a ``SlotOps`` stream."""
        if self._channel_path is not None:
            sock = connect(self._channel_path)
            if sock is not None:
                self.channels_opened += 1
                return ChannelStream(sock, session)
        self.streams_opened += 1
        return _Stream(self._stub, session, self._metadata)
