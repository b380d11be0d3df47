"""The daemon's unix socket: a relay that binds each connection to an address of its own.

gRPC Python tells a servicer nothing about a unix-socket client: ``context.peer()`` is
``"unix:"`` for every connection, so a session id would be a bearer token any process could
use. kvtier therefore accepts on the public socket itself, reads the kernel's ``SO_PEERCRED``
(pid, uid, gid) of each connection, and relays its bytes to gRPC's private socket over a
connection bound to a fresh address in a private directory. gRPC reports that address as the
peer (``unix:<dir>/c<n>``), so a session is bound to the connection that opened it, as on
TCP, and each address maps to the process on the other end.

The bytes move with ``os.splice`` through a pipe, kernel to kernel, on two threads per
connection: bulk data never crosses this socket (it moves through the shared arena), and
neither the event loop nor the GIL is in the way of a call.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 1 << 16
"""Bytes per splice: a pipe's default capacity."""
_UCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class PeerCred:
    """Who is on a connection, as the kernel says (pid in the daemon's pid namespace)."""

    pid: int
    uid: int
    gid: int


class UnixRelay:
    """Accepts on ``public`` and relays each connection to gRPC listening on ``upstream``."""

    def __init__(self, public: Path, private_dir: Path):
        self.public = public
        self.private_dir = private_dir
        self.upstream = private_dir / "grpc.sock"
        self._peers: dict[str, PeerCred] = {}
        self._open: dict[str, tuple[socket.socket, socket.socket, list[threading.Thread]]] = {}
        """Per relayed connection: its two sockets and the two threads that pump them."""
        self._lock = threading.Lock()
        self._count = itertools.count(1)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def address_bytes(self) -> int:
        """Length of the longest address a relayed connection is bound to."""
        return len(os.fsencode(self.private_dir / f"c{2**63}"))

    def clear_private_dir(self) -> None:
        """Removes a dead daemon's sockets from the private directory (sockets only)."""
        for entry in self.private_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()

    def listen(self) -> int:
        """Binds ``public`` (mode 0600), starts accepting; returns the socket's inode."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            listener.bind(os.fspath(self.public))
        except BaseException:
            listener.close()
            raise
        finally:
            os.umask(old)
        os.chmod(self.public, 0o600)
        listener.listen(128)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, name="kvtier-relay", daemon=True)
        self._acceptor.start()
        return os.lstat(self.public).st_ino

    def peer(self, grpc_peer: str) -> PeerCred | None:
        """The process on the relayed connection gRPC names ``grpc_peer``, if it is one."""
        with self._lock:
            return self._peers.get(grpc_peer)

    def close(self) -> None:
        """Stops accepting, ends every relayed connection and waits for its threads."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join()
        with self._lock:
            held = list(self._open.values())
        for client, upstream, threads in held:
            _shut(client, upstream)
            for thread in threads:
                thread.join()

    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                self._relay(client)
            except OSError as exc:
                log.warning("kvtier relay: a connection could not reach gRPC: %s", exc)
                client.close()

    def _relay(self, client: socket.socket) -> None:
        raw = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        cred = PeerCred(*_UCRED.unpack(raw))
        address = self.private_dir / f"c{next(self._count)}"
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.bind(os.fspath(address))
            upstream.connect(os.fspath(self.upstream))
        except BaseException:
            upstream.close()
            address.unlink(missing_ok=True)
            raise
        key = f"unix:{address}"
        threads: list[threading.Thread] = []
        pumping = [2]

        def pump(src: socket.socket, dst: socket.socket) -> None:
            _splice_until_closed(src, dst)
            _shut(client, upstream)  # one side gone: end the other
            with self._lock:
                pumping[0] -= 1
                if pumping[0]:
                    return  # the last of the two cleans up
                del self._peers[key], self._open[key]
            client.close()
            upstream.close()
            address.unlink(missing_ok=True)

        for src, dst in ((client, upstream), (upstream, client)):
            threads.append(
                threading.Thread(target=pump, args=(src, dst), name="kvtier-relay", daemon=True)
            )
        with self._lock:
            self._peers[key] = cred
            self._open[key] = (client, upstream, threads)
        for thread in threads:
            thread.start()


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _splice_until_closed(src: socket.socket, dst: socket.socket) -> None:
    """Moves bytes from ``src`` to ``dst`` until either ends."""
    read_end, write_end = os.pipe()
    try:
        while moved := os.splice(src.fileno(), write_end, _CHUNK):
            while moved:
                moved -= os.splice(read_end, dst.fileno(), moved)
    except OSError:
        pass  # the other side went away; the caller ends both
    finally:
        os.close(read_end)
        os.close(write_end)
