"""The client's end of the slot channel (``service.rpc.slot_channel``): the live session's slot
operations over the daemon's unix socket of their own, without gRPC.

A caller sends its operation itself, one frame under a lock (no hand-off to another thread on
the way out), and a caller that waits reads the answers itself where no other thread is
reading (``wait``), handing others' answers to theirs; else the reader thread does. A thread
that reads for others costs each answer a second thread's wake-up: on the 2-core VM a 4-block
Acquire and Release, each pair after a 50 ms pause, took 1.18 ms (p50) with the reader thread
reading, 0.91 read by their caller. It offers what ``slot_stream`` uses of a ``SlotOps``
stream, so ``SlotCalls`` treats the two alike: an operation answers as its unary call would,
and when the channel breaks every operation waiting on it fails with the channel's status (the
daemon's last frame's, or ``UNAVAILABLE``).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time

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
        self._closed = False
        self._send_lock = threading.Lock()
        self._io_timeout = 0.0
        self._reading = threading.Lock()
        """Held by the one thread reading answers off the socket: a waiting caller or the
        reader thread. Frames are read whole and unbuffered, so ``poll`` sees what is left."""
        self._caller_poll = select.poll()
        self._caller_poll.register(sock, select.POLLIN)
        self._last_word = StreamError(grpc.StatusCode.UNAVAILABLE, "the slot channel ended")
        self._ended = False
        """Set (holding ``_reading``) once a caller found the channel ended or broken: the
        reader thread then fails what waits, reading nothing more."""
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
                self._bound_io(timeout)
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

    def wait(self, future: OpFuture, timeout: float):
        """``future.result(timeout)``, its answer read off the socket by this thread where no
        other thread is reading (each answer read on the way goes to its own waiter)."""
        deadline = time.monotonic() + timeout
        if not future.done() and self._reading.acquire(blocking=False):
            try:
                self._read_until(future, deadline)
            finally:
                self._reading.release()
        return future.result(max(0.0, deadline - time.monotonic()))

    def _read_until(self, future: OpFuture, deadline: float) -> None:
        """Reads answers until ``future``'s came, its deadline passed or the channel ended
        (the reader thread then fails what waits)."""
        try:
            while not future.done() and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0 or not self._caller_poll.poll(left * 1e3):
                    return
                self._ended = not self._read_frame()
        except (OSError, ValueError, DecodeError) as exc:
            log.debug("kvtier slot channel: read failed: %s", exc)
            self._ended = True  # what follows a frame cut short or garbled is read by nobody
            self._shut()

    def _bound_io(self, timeout: float) -> None:
        """A daemon that stops reading (frozen) must not hold a caller past its deadline in a
        send to a full socket, nor one that stops mid-frame a reader: a send or a read gives
        up (and the channel with it) once ``timeout`` passes. Set only when it changes: the
        calls of one client share their deadline."""
        wait = max(timeout, 1e-3)  # 0 would mean no bound at all
        if wait != self._io_timeout:
            timeval = _TIMEVAL.pack(int(wait), int(wait % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            self._io_timeout = wait

    def _shut(self) -> None:
        with contextlib.suppress(OSError):  # already shut
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        """The reader thread: reads what arrives while no caller is reading, until the
        channel ends; then fails every operation still waiting."""
        ready = select.poll()
        ready.register(self._sock, select.POLLIN)
        try:
            while True:
                ready.poll()
                with self._reading:
                    if self._ended or (ready.poll(0) and not self._read_frame()):
                        break
        except (OSError, ValueError, DecodeError) as exc:
            log.debug("kvtier slot channel: read failed: %s", exc)
        with self._reading:
            error = self._last_word
            if self._closed:  # as a gRPC stream cancelled by its client ends
                error = StreamError(grpc.StatusCode.CANCELLED, "the client closed the slot channel")
            pending = self.pending.end(error)
            self._sock.close()
        for op in pending:
            op.future.finish(error=error, cancelled=self._closed)

    def _read_frame(self) -> bool:
        """Reads one frame and hands out its answers; False once the channel ended (a frame
        cut short too). Call holding ``_reading``."""
        head = self._receive(FRAME.size)
        if head is None:
            return False
        (size,) = FRAME.unpack(head)
        body = self._receive(size)
        if body is None:
            return False
        for result in pb.SlotResultBatch.FromString(body).results:
            if result.op_id:
                self.pending.answer(result)
            else:  # the daemon's last word: why it ends the channel
                self._last_word = StreamError(code_of(result.code), result.message)
        return True

    def _receive(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes, or None if the channel ends first (one ``recv`` when the
        whole frame is there, as it mostly is)."""
        data = b""
        while len(data) < size:
            more = self._sock.recv(size - len(data))
            if not more:
                return None
            data += more
        return data
