"""The slot channel: a session's slot operations over a unix socket of their own, without gRPC.

gRPC Python costs about 0.55 ms a round trip on the 2-core VM (a bare health ``Check``), ten
times a message between the same two processes over a plain unix socket, and a slot operation
is a round trip the engine waits for. The channel carries the ``SlotOps`` stream's messages,
each framed by its length (``contract.FRAME``): ``SlotOpBatch`` frames in, ``SlotResultBatch``
frames out, run through the stream's own code (``slot_ops``), so every operation is checked,
answered and refused as its unary call would be.

Binding: the socket (``contract.slot_channel_path``) sits beside the daemon's, mode 0600, so
only the daemon's user reaches it. The kernel names the process of each connection
(``SO_PEERCRED``); the first batch names a session, which that same process must have opened
through the relay (whose address for it names the client's pid, ``relay.unix``). The channel
then speaks for that session's connection, with the session checks, shares, holds and fence
its gRPC stream has. A session opened over TCP, or by another process, is refused.

The channel ends, with a last frame holding one ``SlotResult`` of ``op_id`` 0 that carries the
status the stream would have ended with, when a batch cannot be taken (a frame too large or
undecodable, a session not this process's), or when the daemon stops; it ends without one
when the client closes its side, once every operation is answered.

Each connection is an ``asyncio.Protocol``, not a pair of streams and tasks: the frames that
one read brings are decoded, their operations run at once as far as they go without waiting
(``eager``), and the answers made meanwhile leave in one frame, all in the one turn of the
event loop that the read woke. Streams, a task per operation and a queue to the writer took
three turns, about 50 µs each on the 2-core VM, for an operation whose work is 20 µs. An
operation that must wait (a disk hit's promotion, a batch on a worker thread) is answered in
a frame of its own when it finishes. Reading stops while ``slot_ops_in_flight`` operations
wait, or while the client reads no answers (the socket's buffer is full), so neither can grow
the daemon's memory.

A notice (a lookup the client's index probe answered, ``probed_host`` set) is one operation
whose answer nobody waits for, and it runs after the operations that came with it and those
that arrive before the event loop next polls its sockets (``_defer``). Its client sends it from
a thread the moment the lookup returns, and the Acquire that loads the hits follows at once
(from that client, or from a worker of the same engine on a channel of its own): one read or
one poll often brings both. Taken in order, the Acquire waited for the notice's walk of a
1,000-hash prefix, 0.25 ms back to back and 0.8 ms after an idle pause on the 2-core VM, and
with 8 paced clients there the p99 of the slot operations was 2.5 to 2.9 ms, 1.7 to 2.0 with
the notices deferred. An Acquire that overtakes its notice pins its blocks itself; the
notice then holds the lookup's hits as always, and a hold on a block acquired meanwhile ends
at its deadline (``lookup_hold_s``) or with a later acquire, as the holds of hits nobody
acquires do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import FRAME, MAX_SLOT_OPS
from kvtier.service.rpc.calls import REFUSALS, status_of
from kvtier.service.rpc.handlers import REQUEST_LIMITS, Refused, guarded_decoder
from kvtier.service.rpc.slot_ops import SlotOpRunner
from kvtier.service.rpc.wire import RequestError
from kvtier.service.tunables import TUNABLES

_UCRED = struct.Struct("3i")
_decode = guarded_decoder("SlotOps", pb.SlotOpBatch)
_FRAME_LIMIT = REQUEST_LIMITS["SlotOps"]


class _Context:
    """What ``slot_ops`` asks of a gRPC servicer context: the peer the session is bound to."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def _is_notice(op: pb.SlotOp) -> bool:
    """Whether ``op`` is a lookup the client's index probe answered: its answer goes unread."""
    return op.WhichOneof("op") == "lookup" and op.lookup.HasField("probed_host")


class SlotChannelServer:
    """Serves the slot channel of ``servicer`` on ``path`` until ``close``.

    ``client_pid(peer)`` is the client pid a relayed connection's address names (None for
    any other peer). Connections beyond ``max_connections`` are ended at once, so that a
    client opening them without end cannot take the daemon's descriptors."""

    def __init__(
        self,
        servicer,
        path: Path,
        client_pid: Callable[[str], int | None],
        max_connections: int,
    ):
        self.servicer = servicer
        self.channels: set[_Channel] = set()
        self.max_connections = max_connections
        self._path = path
        self._client_pid = client_pid
        self._server: asyncio.base_events.Server | None = None
        self._stopping: asyncio.Task | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _Channel(self), path=os.fspath(self._path)
        )
        os.chmod(self._path, 0o600)
        self._stopping = asyncio.create_task(self._end_all_when_stopping())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._stopping is not None:
            self._stopping.cancel()
        self._end_all()

    async def _end_all_when_stopping(self) -> None:
        await self.servicer.stopping.wait()
        self._end_all()

    def _end_all(self) -> None:
        for channel in list(self.channels):
            channel.end(RequestError(grpc.StatusCode.UNAVAILABLE, "daemon stopping"))

    def peer_for(self, first: pb.SlotOpBatch, sock: socket.socket) -> str:
        """The connection the first batch's session is bound to, if the process at the other
        end of ``sock`` opened it through the relay; else ``RequestError``."""
        pid, _, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        peer = self.servicer.daemon.sessions.peer_of(first.session_id)
        if peer is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"unknown session {first.session_id!r:.40}"
            )
        if self._client_pid(peer) != pid:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                "this session belongs to another process's connection",
            )
        return peer


class _Channel(asyncio.Protocol):
    """One client's connection: its frames in, its session's answers out."""

    def __init__(self, server: SlotChannelServer):
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._ops: SlotOpRunner | None = None
        self._answers: list[pb.SlotResult] = []
        self._waiting: set[asyncio.Task] = set()
        self._notices: list[pb.SlotOp] = []
        """Notices ``_defer`` holds back until the loop's next poll of its sockets."""
        self._taking = False
        """Inside ``_take``: answers gather, to leave in one frame when it returns."""
        self._reading_paused = False
        self._writing_paused = False
        self._client_done = False
        self._ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._server.channels.add(self)
        if len(self._server.channels) > self._server.max_connections:
            most = self._server.max_connections
            self.end(
                RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{most} slot channels are open, the most this daemon takes",
                )
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True  # what still runs is answered to no one, as the client went away
        self._server.channels.discard(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._take()

    def eof_received(self) -> bool:
        self._client_done = True
        self._settle()
        return True  # half open: what still runs is answered before the channel closes

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._settle()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._settle()

    def end(self, refusal: BaseException) -> None:
        """Ends the channel with ``refusal``'s status, after the answers already made."""
        if self._ended:
            return
        code, details = status_of(refusal)
        self._answers.append(pb.SlotResult(code=code.value[0], message=details))
        self._send()
        self._ended = True
        self._transport.close()

    @contextlib.contextmanager
    def _one_frame(self) -> Iterator[None]:
        """The answers made inside leave in one frame at its end; then reading is settled."""
        self._taking = True
        try:
            yield
        finally:
            self._taking = False
            self._send()
        self._settle()

    def _take(self) -> None:
        """Runs the operations of every whole frame buffered, unless reading is held."""
        with self._one_frame():
            try:
                while not self._ended and not self._held():
                    batch = self._next_batch()
                    if batch is None:
                        break
                    self._start(batch)
            except REFUSALS as exc:
                if self._ops is not None:
                    self._server.servicer.refused(self._ops.context, exc, status_of(exc)[1])
                self.end(exc)

    def _next_batch(self) -> pb.SlotOpBatch | None:
        """The first whole frame's batch, taken off the buffer; None until one is whole.
        Raises ``RequestError`` for a frame that cannot be taken."""
        if len(self._buffer) < FRAME.size:
            return None
        (size,) = FRAME.unpack_from(self._buffer)
        if size > _FRAME_LIMIT:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a slot channel frame of {size} B exceeds {_FRAME_LIMIT} B",
                "SlotOps-too-large",
            )
        end = FRAME.size + size
        if len(self._buffer) < end:
            return None
        # one copy of the frame (a bytearray slice is one already): the decoded message must
        # not refer to the buffer, which shrinks next
        batch = _decode(bytes(memoryview(self._buffer)[FRAME.size : end]))
        del self._buffer[:end]
        if isinstance(batch, Refused):
            raise RequestError(batch.code, batch.message, batch.kind)
        return batch

    def _start(self, batch: pb.SlotOpBatch) -> None:
        if self._ops is None:
            peer = self._server.peer_for(batch, self._transport.get_extra_info("socket"))
            self._ops = SlotOpRunner(self._server.servicer, _Context(peer), self._answer)
        self._ops.check(batch)
        for op in batch.ops:
            if _is_notice(op):
                self._defer(op)
            else:
                self._run(op)

    def _run(self, op: pb.SlotOp) -> None:
        task = self._ops.start(op)
        if task is not None:
            self._waiting.add(task)
            task.add_done_callback(self._finished)

    def _defer(self, notice: pb.SlotOp) -> None:
        """Runs ``notice`` once the event loop has polled its sockets again: a timer due now
        runs after the callbacks of the reads that poll finds (asyncio runs the ready I/O
        first), a callback made ready now would run before them."""
        if not self._notices:
            asyncio.get_running_loop().call_later(0, self._run_notices)
        self._notices.append(notice)

    def _run_notices(self) -> None:
        notices, self._notices = self._notices, []
        if self._ended:
            return
        with self._one_frame():
            for notice in notices:
                self._run(notice)

    def _answer(self, result: pb.SlotResult) -> None:
        self._answers.append(result)
        if not self._taking:
            self._send()

    def _finished(self, task: asyncio.Task) -> None:
        self._waiting.discard(task)
        self._settle()

    def _send(self) -> None:
        answers, self._answers = self._answers, []
        if self._ended:
            return
        for first in range(0, len(answers), MAX_SLOT_OPS):
            batch = pb.SlotResultBatch(results=answers[first : first + MAX_SLOT_OPS])
            raw = batch.SerializeToString()
            self._transport.write(FRAME.pack(len(raw)) + raw)

    def _held(self) -> bool:
        return self._writing_paused or len(self._waiting) >= TUNABLES.slot_ops_in_flight

    def _settle(self) -> None:
        """Holds or resumes reading as ``_held`` says (taking the frames buffered meanwhile on
        resuming), and closes the channel once the client ended its side and all is answered."""
        if self._ended:
            return
        held = self._held()
        if held != self._reading_paused:
            self._reading_paused = held
            if held:
                self._server.servicer.metrics.slot_channel_holds.inc()
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()
                self._take()
                return
        if self._client_done and not self._waiting and not self._notices and not held:
            self._ended = True
            self._transport.close()
