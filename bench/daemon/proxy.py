"""A TCP proxy that makes a store slow: what a slow remote store costs the daemon's callers.

A chunk a client sends that carries the command ``slow`` (every chunk when ``slow`` is empty)
is held ``delay_s`` before it goes on: a store that answers such requests that much later.
(Naming the command keeps the delay per request: a large write spans many chunks.) While the
gate is shut, a chunk carrying the gated command waits until it opens (``held`` says one is
waiting). Replies pass straight back. One thread per direction of each connection; ``close``
ends them all.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class SlowProxy:
    """Listens on 127.0.0.1:``port`` and relays to 127.0.0.1:``upstream_port``."""

    def __init__(self, upstream_port: int, delay_s: float = 0.0, slow: bytes = b""):
        self.delay_s = delay_s
        self._slow = slow
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._gated = b""
        self.held = threading.Event()
        """Set once a chunk waits at the shut gate."""
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def shut(self, command: bytes) -> None:
        """Holds every chunk that carries ``command`` (e.g. ``b"EXISTS"``) until ``open``."""
        self._gated = command
        self.held.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="slow-proxy")
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                store = socket.create_connection(self._upstream, timeout=10)
                store.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    store.close()
                    return
                self._sockets += [client, store]
                self._spawn(self._pump, client, store, True)
                self._spawn(self._pump, store, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, hold: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if hold:
                    self._hold(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def _hold(self, data: bytes) -> None:
        if not self._open.is_set() and self._gated and self._gated in data:
            self.held.set()
            self._open.wait()
        if self.delay_s and self._slow in data:
            time.sleep(self.delay_s)
