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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import FRAME
from kvtier.service.rpc import slot_ops
from kvtier.service.rpc.handlers import REQUEST_LIMITS, Refused, guarded_decoder

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")
_decode = guarded_decoder("SlotOps", pb.SlotOpBatch)


class _Ended(Exception):
    """The stream's abort: the channel ends with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """What ``slot_ops`` asks of a gRPC servicer context: the peer the session is bound to,
    and an abort."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Ended(code, details)


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
        self._servicer = servicer
        self._path = path
        self._client_pid = client_pid
        self._max_connections = max_connections
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(
            self._serve, path=os.fspath(self._path), limit=1 << 16
        )
        os.chmod(self._path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            if len(self._connections) > self._max_connections:
                await _send_end(
                    writer,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._max_connections} slot channels are open, the most this daemon takes",
                )
                return
            await self._converse(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; its operations were answered or are moot
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await _next_batch(reader)
        if first is None:
            return
        peer = self._peer_for(first, writer.get_extra_info("socket"))
        if isinstance(peer, Refused):
            await _send_end(writer, peer.code, peer.message)
            return
        try:
            async for results in slot_ops.serve(
                self._servicer, _batches(first, reader), _Context(peer)
            ):
                _send(writer, results)
                await writer.drain()
        except _Ended as ended:
            await _send_end(writer, ended.code, ended.details)

    def _peer_for(self, first: pb.SlotOpBatch | Refused, sock: socket.socket) -> str | Refused:
        """The connection the first batch's session is bound to, if the process at the other
        end of ``sock`` opened it through the relay; else the refusal to end with."""
        if isinstance(first, Refused):
            return first
        pid, _, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        peer = self._servicer.daemon.sessions.peer_of(first.session_id)
        if peer is None:
            return Refused(
                grpc.StatusCode.NOT_FOUND, f"unknown session {first.session_id!r:.40}", ""
            )
        if self._client_pid(peer) != pid:
            return Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                "this session belongs to another process's connection",
                "",
            )
        return peer


async def _next_batch(reader: asyncio.StreamReader) -> pb.SlotOpBatch | Refused | None:
    """The next frame's batch (a ``Refused`` if it cannot be taken); None at the client's end."""
    try:
        head = await reader.readexactly(FRAME.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    (size,) = FRAME.unpack(head)
    if size > REQUEST_LIMITS["SlotOps"]:
        return Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a slot channel frame of {size} B exceeds {REQUEST_LIMITS['SlotOps']} B",
            "SlotOps-too-large",
        )
    return _decode(await reader.readexactly(size))


async def _batches(first, reader: asyncio.StreamReader) -> AsyncIterator:
    """The first batch, then each frame's until the client ends its side or sends one that
    cannot be taken (after which nothing more is read)."""
    batch = first
    while batch is not None:
        yield batch
        if isinstance(batch, Refused):
            return
        batch = await _next_batch(reader)


def _send(writer: asyncio.StreamWriter, message) -> None:
    raw = message.SerializeToString()
    writer.write(FRAME.pack(len(raw)) + raw)


async def _send_end(writer: asyncio.StreamWriter, code: grpc.StatusCode, details: str) -> None:
    _send(writer, pb.SlotResultBatch(results=[pb.SlotResult(code=code.value[0], message=details)]))
    await writer.drain()
