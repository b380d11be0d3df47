"""The client's end of the slot channel (``service.rpc.slot_channel``): the live session's slot
operations over the daemon's unix socket of their own, without gRPC.

A caller sends its operation itself, one frame under a lock (no hand-off to another thread on
the way out); a reader thread hands each answer to the caller waiting for its id. It offers
what ``slot_stream`` uses of a ``SlotOps`` stream, so ``SlotCalls`` treats the two alike: an
operation answers as its unary call would, and when the channel breaks every operation waiting
on it fails with the channel's status (the daemon's last frame's, or ``UNAVAILABLE``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading

import grpc
from google.protobuf.message import DecodeError

from kvtier.connector.client.slot_answers import (
    OP_FIELDS,
    OpFuture,
    PendingOps,
    StreamError,
    code_of,
)
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import FRAME

log = logging.getLogger(__name__)

_TIMEVAL = struct.Struct("ll")
"""``struct timeval``: seconds, microseconds."""


def connect(path: str, timeout: float = 1.0) -> socket.socket | None:
    """A connection to the slot channel at ``path``; None where there is none to reach (a
    daemon from before the channel). ``timeout`` bounds a connect to a full backlog only."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    sock.settimeout(None)
    return sock


class ChannelStream:
    """The slot channel of ``session`` over ``sock`` (connected)."""

    def __init__(self, sock: socket.socket, session: str):
        self.session = session
        self.pending = PendingOps()
        self._sock = sock
        self._frames = sock.makefile("rb")
        self._closed = False
        self._send_lock = threading.Lock()
        self._send_timeout = 0.0
        self._reader = threading.Thread(target=self._read, name="kvtier-slot-channel", daemon=True)
        self._reader.start()

    def unimplemented(self) -> bool:
        """Never: a daemon without the channel has no socket to connect to."""
        return False

    def put(self, op_id: int, method: str, request, timeout: float) -> OpFuture | None:
        """Sends an operation; None if the channel is broken (the caller goes another way)."""
        future = self.pending.add(op_id, method, request, timeout)
        if future is None:
            return None
        batch = pb.SlotOpBatch(
            session_id=self.session,
            ops=[pb.SlotOp(op_id=op_id, **{OP_FIELDS[method][0]: request})],
        )
        raw = batch.SerializeToString()
        try:
            with self._send_lock:
                self._bound_sends(timeout)
                self._sock.sendall(FRAME.pack(len(raw)) + raw)
        except OSError as exc:
            # The reader sees the channel end too and fails what waits, this operation included.
            log.debug("kvtier slot channel: send failed: %s", exc)
            self._shut()
        return future

    def close(self) -> None:
        """Ends the channel; what still waits on it fails as cancelled by the client."""
        self._closed = True
        self._shut()

    def _bound_sends(self, timeout: float) -> None:
        """A daemon that stops reading (frozen) must not hold a caller past its deadline in a
        send to a full socket: a send gives up (and the channel with it) once ``timeout``
        passes. Set only when it changes: the calls of one client share their deadline."""
        wait = max(timeout, 1e-3)  # 0 would mean no bound at all
        if wait != self._send_timeout:
            timeval = _TIMEVAL.pack(int(wait), int(wait % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            self._send_timeout = wait

    def _shut(self) -> None:
        with contextlib.suppress(OSError):  # already shut
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        error = StreamError(grpc.StatusCode.UNAVAILABLE, "the slot channel ended")
        try:
            while (batch := self._next_batch()) is not None:
                for result in batch.results:
                    if result.op_id:
                        self.pending.answer(result)
                    else:  # the daemon's last word: why it ends the channel
                        error = StreamError(code_of(result.code), result.message)
        except (OSError, DecodeError) as exc:
            log.debug("kvtier slot channel: read failed: %s", exc)
        if self._closed:  # as a gRPC stream cancelled by its client ends
            error = StreamError(grpc.StatusCode.CANCELLED, "the client closed the slot channel")
        pending = self.pending.end(error)
        self._frames.close()
        self._sock.close()
        for op in pending:
            op.future.finish(error=error, cancelled=self._closed)

    def _next_batch(self) -> pb.SlotResultBatch | None:
        """The next frame's results; None once the channel ends (a frame cut short too)."""
        head = self._frames.read(FRAME.size)
        if len(head) < FRAME.size:
            return None
        (size,) = FRAME.unpack(head)
        body = self._frames.read(size)
        return pb.SlotResultBatch.FromString(body) if len(body) == size else None
