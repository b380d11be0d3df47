"""The relay's selector loop in this process, between real unix sockets: a stand-in for gRPC's
socket whose backlog fills, the connection cap, and connections that break."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import pytest

from kvtier.service.relay.limits import connection_cap
from kvtier.service.relay.loop import Relay
from kvtier.service.relay.unix import client_pid

WAIT_S = 30.0


class Stage:
    """A public socket, a relay on it, and a listening socket where gRPC's would be."""

    def __init__(self, root: Path, max_connections: int, backlog: int):
        self.root = root
        self.upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.upstream.bind(os.fspath(root / "grpc.sock"))
        self.upstream.listen(backlog)
        self.public = root / "public.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.fspath(self.public))
        listener.listen(64)
        self.relay = Relay(listener, root, root / "grpc.sock", max_connections)
        self.socks = [self.upstream, listener]

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(os.fspath(self.public))
        sock.settimeout(WAIT_S)
        self.socks.append(sock)
        return sock

    def accept(self) -> socket.socket:
        """gRPC's side of the next relayed connection."""
        self.upstream.settimeout(0)
        while True:
            try:
                sock, _ = self.upstream.accept()
            except BlockingIOError:
                self.step()
                continue
            sock.settimeout(WAIT_S)
            self.socks.append(sock)
            return sock

    def step(self) -> None:
        self.relay.step(0.01)

    def until(self, condition, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()

    def echo(self, client: socket.socket, server: socket.socket, data: bytes) -> None:
        """``data`` through the relay both ways, exact."""
        assert self.carry(client, server, data) == data
        assert self.carry(server, client, data[::-1]) == data[::-1]

    def carry(self, src: socket.socket, dst: socket.socket, data: bytes) -> bytes:
        """Sends ``data`` from ``src``, stepping the relay, until ``dst`` has read as much."""
        src.setblocking(False)
        dst.setblocking(False)
        view, got = memoryview(data), bytearray()
        deadline = time.monotonic() + WAIT_S
        while len(got) < len(data):
            assert time.monotonic() < deadline, f"{len(got)} of {len(data)} bytes came through"
            if view:
                with contextlib.suppress(BlockingIOError):
                    view = view[src.send(view) :]
            self.step()
            with contextlib.suppress(BlockingIOError):
                got += dst.recv(1 << 20)
        return bytes(got)

    def addresses(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.name.startswith("c"))

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@pytest.fixture
def stage(tmp_path):
    made: list[Stage] = []

    def make(max_connections: int = 64, backlog: int = 64) -> Stage:
        made.append(Stage(tmp_path, max_connections, backlog))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_bytes_cross_both_ways_over_an_address_that_names_the_client(stage):
    s = stage()
    client = s.connect()
    server = s.accept()
    assert client_pid(f"unix:{server.getpeername()}", s.root) == os.getpid()
    s.echo(client, server, os.urandom(3 << 20))  # many chunks, and a reader that lags
    client.close()
    s.until(lambda: not s.addresses(), "the closed connection's address removed")
    server.setblocking(True)
    assert server.recv(1) == b""


def test_connections_wait_for_room_in_a_full_backlog_then_go_through(stage):
    s = stage(backlog=0)  # one connection waits in it, the next is refused with EAGAIN
    clients = [s.connect() for _ in range(5)]
    s.until(lambda: s.relay.connections == 5, "every connection taken")
    assert s.relay.waiting > 0, "the backlog never filled"
    servers = [s.accept() for _ in clients]
    for i, (client, server) in enumerate(zip(clients, servers, strict=True)):
        s.echo(client, server, f"connection {i}".encode())


def test_connections_beyond_the_cap_are_closed_and_the_others_go_on(stage):
    s = stage(max_connections=2)
    kept = [s.connect() for _ in range(2)]
    servers = [s.accept() for _ in kept]
    s.until(lambda: s.relay.connections == 2, "two connections relayed")
    refused = s.connect()
    refused.setblocking(False)

    def closed() -> bool:
        try:
            return refused.recv(1) == b""
        except BlockingIOError:
            return False

    s.until(closed, "the third connection closed")
    for client, server in zip(kept, servers, strict=True):
        s.echo(client, server, b"still here")


def test_a_connection_broken_on_either_side_ends_that_connection_only(stage):
    s = stage()
    pairs = [(s.connect(), s.accept()) for _ in range(3)]
    pairs[0][0].close()  # the client goes
    client, server = pairs[1]
    assert s.carry(client, server, b"read") == b"read"
    client.send(b"never read")
    s.step()
    server.close()  # gRPC drops a connection with bytes unread: the relay's recv is reset
    s.until(lambda: s.relay.connections == 1, "the two broken connections ended")
    s.echo(*pairs[2], b"unaffected")
    assert len(s.addresses()) == 1


def test_the_cap_leaves_room_for_both_processes_descriptors():
    assert connection_cap(1024, 10_000) == (1024 - 32) // 2
    assert connection_cap(1 << 20, 2112) == 2112
    assert connection_cap(300, 2112) == 300 - 256
    assert connection_cap(100, 2112) == 1
