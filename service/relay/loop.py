"""The relay's loop: every connection of the unix socket on one selector thread.

Each accepted connection is paired with a connection to gRPC's private socket, bound to the
address that names the client (``unix.py``). Bytes move both ways through one shared buffer;
a direction whose destination is full stops reading its source until it drains, so a slow
reader parks at most one chunk here. A connection costs two descriptors and no thread.
Connections beyond ``max_connections`` are closed at once; an error on one connection (its
peer gone, gRPC's backlog full, no descriptor left) ends that connection, never the relay.
Refusals and errors are logged at a bounded rate, since a client can cause them at will.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import selectors
import socket
import struct
import time
from collections import deque
from pathlib import Path

from kvtier.service.tunables import TUNABLES
from kvtier.tiers.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

_CHUNK = 1 << 16
"""Bytes read per call: the most a connection parks here while its reader is slow."""
_UCRED = struct.Struct("3i")
_ACCEPT_BATCH = 64
"""Connections accepted per wake-up, so that a flood of them cannot starve relayed bytes."""
_RETRY_S = 0.01
"""Pause before a connection to gRPC's full backlog is tried again."""
_OUT_OF_ROOM = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_GONE_BEFORE_ACCEPT = frozenset((errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR))
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class _Link:
    """One relayed connection: ``socks`` is (client, gRPC), ``unsent[i]`` the bytes read from
    the other side not yet written to ``socks[i]``, ``masks[i]`` what ``socks[i]`` waits for."""

    __slots__ = ("address", "deadline", "ending", "masks", "open", "socks", "unsent")

    def __init__(self, client: socket.socket, upstream: socket.socket, address: Path):
        self.socks = (client, upstream)
        self.address = address
        self.unsent = [b"", b""]
        self.masks = [0, 0]
        self.ending = False
        self.open = True
        self.deadline = 0.0


class Relay:
    """Accepts on ``listener`` (bound and listening) and relays each connection to gRPC's
    socket ``upstream``, over a connection bound to ``private_dir/c<pid>.<n>-<client pid>``."""

    def __init__(
        self, listener: socket.socket, private_dir: Path, upstream: Path, max_connections: int
    ):
        self.listener = listener
        self.private_dir = private_dir
        self.upstream = os.fspath(upstream)
        self.max_connections = max_connections
        self._count = itertools.count(1)
        self._selector = selectors.DefaultSelector()
        self._buffer = bytearray(_CHUNK)
        self._view = memoryview(self._buffer)
        self._links: set[_Link] = set()
        self._connecting: deque[_Link] = deque()
        self._accept_again_at: float | None = None
        self._log = RateLimitedLog(log)
        listener.setblocking(False)
        self._selector.register(listener, _READ)

    @property
    def connections(self) -> int:
        """Connections relayed or waiting for room in gRPC's backlog."""
        return len(self._links) + len(self._connecting)

    @property
    def waiting(self) -> int:
        """Connections waiting for room in gRPC's backlog."""
        return len(self._connecting)

    def serve_forever(self) -> None:
        while True:
            self.step(self._timeout())

    def step(self, timeout: float | None) -> None:
        """Waits up to ``timeout`` seconds for sockets to be ready and serves them."""
        for key, events in self._selector.select(timeout):
            if key.data is None:
                self._accept()
            else:
                link, side = key.data
                self._serve(link, side, events)
        if self._connecting:
            self._retry_connects()
        if self._accept_again_at is not None and time.monotonic() >= self._accept_again_at:
            self._accept_again_at = None
            self._selector.register(self.listener, _READ)

    def _timeout(self) -> float | None:
        if self._connecting or self._accept_again_at is not None:
            return _RETRY_S
        return None

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                client, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_ROOM:
                    self._rest_accepting(exc)
                    return
                if exc.errno in _GONE_BEFORE_ACCEPT:
                    continue  # that connection only
                raise  # the listener itself is broken: the daemon starts a new relay
            if self.connections >= self.max_connections:
                client.close()
                self._log.warning(
                    "refused",
                    "kvtier relay: refused a connection: %d are open, the most this relay "
                    "takes (the descriptor limit and --max-sessions bound it)",
                    self.connections,
                )
                continue
            self._admit(client)

    def _rest_accepting(self, exc: OSError) -> None:
        """Stops accepting for a moment: what waits in the backlog waits there, and the
        listener, still readable, would otherwise wake the loop without end."""
        self._selector.unregister(self.listener)
        self._accept_again_at = time.monotonic() + TUNABLES.relay_accept_pause_s
        self._log.warning(
            "no room",
            "kvtier relay: cannot accept (%s) with %d connections open; new ones wait",
            exc.strerror,
            self.connections,
        )

    def _admit(self, client: socket.socket) -> None:
        """Pairs ``client`` with a connection to gRPC bound to the address that names it."""
        upstream = None
        address = None
        try:
            client.setblocking(False)
            raw = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            pid, _uid, _gid = _UCRED.unpack(raw)
            address = self.private_dir / f"c{os.getpid()}.{next(self._count)}-{pid}"
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.setblocking(False)
            upstream.bind(os.fspath(address))
        except OSError as exc:
            client.close()
            if upstream is not None:
                upstream.close()
            if address is not None:
                address.unlink(missing_ok=True)
            self._could_not_relay(exc)
            return
        link = _Link(client, upstream, address)
        link.deadline = time.monotonic() + TUNABLES.relay_connect_timeout_s
        if self._connect(link):
            self._start(link)
        elif link.open:
            self._connecting.append(link)

    def _connect(self, link: _Link) -> bool:
        """Connects ``link`` to gRPC: True once connected, False while gRPC's backlog is full
        (a unix socket says so at once instead of queueing) or when it failed (link closed)."""
        try:
            link.socks[1].connect(self.upstream)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno == errno.EISCONN:
                return True
            self._close(link)
            self._could_not_relay(exc)
            return False
        return True

    def _retry_connects(self) -> None:
        now = time.monotonic()
        for _ in range(len(self._connecting)):
            link = self._connecting.popleft()
            if self._connect(link):
                self._start(link)
            elif not link.open:
                continue
            elif now >= link.deadline:
                self._close(link)
                self._could_not_relay(TimeoutError("gRPC's backlog stayed full"))
            else:
                self._connecting.append(link)

    def _could_not_relay(self, exc: BaseException) -> None:
        self._log.warning("unreachable", "kvtier relay: a connection could not reach gRPC: %s", exc)

    def _start(self, link: _Link) -> None:
        self._links.add(link)
        try:
            self._watch(link)
        except OSError as exc:  # the selector itself out of room
            self._close(link)
            self._could_not_relay(exc)

    def _serve(self, link: _Link, side: int, events: int) -> None:
        if not link.open:
            return  # ended by an earlier event of this wake-up
        try:
            if events & _WRITE:
                self._flush(link, side)
            if events & _READ and not link.ending:
                self._pump(link, side)
            self._watch(link)
        except OSError as exc:
            log.debug("kvtier relay: %s ended: %s", link.address.name, exc)
            self._close(link)

    def _pump(self, link: _Link, side: int) -> None:
        """Reads what ``socks[side]`` holds and sends it on to the other side; what the other
        side cannot take now waits in ``unsent`` (and reading ``side`` waits for it)."""
        other = 1 - side
        if link.unsent[other]:
            return  # the other side still owes what was read before
        got = link.socks[side].recv_into(self._buffer)
        if not got:
            link.ending = True  # one side gone: end the other once what it is owed is sent
            return
        sent = _send(link.socks[other], self._view[:got])
        if sent < got:
            link.unsent[other] = bytes(self._view[sent:got])

    def _flush(self, link: _Link, side: int) -> None:
        data = link.unsent[side]
        if data:
            link.unsent[side] = data[_send(link.socks[side], data) :]

    def _watch(self, link: _Link) -> None:
        """Registers each socket for what it waits for now; ends a link with nothing left to
        send once a side has gone."""
        if link.ending and not any(link.unsent):
            self._close(link)
            return
        for side in (0, 1):
            mask = 0
            if not link.ending and not link.unsent[1 - side]:
                mask |= _READ
            if link.unsent[side]:
                mask |= _WRITE
            if mask == link.masks[side]:
                continue
            sock = link.socks[side]
            if not link.masks[side]:
                self._selector.register(sock, mask, (link, side))
            elif not mask:
                self._selector.unregister(sock)
            else:
                self._selector.modify(sock, mask, (link, side))
            link.masks[side] = mask

    def _close(self, link: _Link) -> None:
        if not link.open:
            return
        link.open = False
        self._links.discard(link)
        for side, sock in enumerate(link.socks):
            if link.masks[side]:
                link.masks[side] = 0
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with contextlib.suppress(OSError):
            link.address.unlink(missing_ok=True)


def _send(sock: socket.socket, data: bytes | memoryview) -> int:
    """Bytes of ``data`` that ``sock`` took now."""
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
