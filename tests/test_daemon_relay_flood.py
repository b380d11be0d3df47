"""The unix socket's relay under a flood of connections: it survives, relays every connection
its descriptor limit leaves room for, refuses the rest, and the clients it took keep working."""

from __future__ import annotations

import contextlib
import os
import resource
import socket

import pytest

from kvtier.proto import kvtier_pb2 as pb

from daemonutil import BLOCK_BYTES, Daemon, open_session, relay_pids, wait_until

FLOOD = 1200
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""What an HTTP/2 client sends first: the connection preface and an empty SETTINGS frame."""
COMMON_SOFT_LIMIT = 1024
"""The soft descriptor limit most distributions give a process."""


@pytest.fixture
def room_for_a_flood():
    """This process's soft descriptor limit raised for ``FLOOD`` sockets; yields the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * FLOOD:
        pytest.skip(f"a flood of {FLOOD} connections needs a hard descriptor limit of {4 * FLOOD}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def flood(daemon: Daemon, count: int):
    """``count`` connections to the daemon's socket at once, each having sent an HTTP/2
    preface and none yet closed."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.settimeout(60)
            wait_until(lambda s=sock: connected(s, daemon), "room in the socket's backlog")
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused at once
                sock.sendall(PREFACE)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def connected(sock: socket.socket, daemon: Daemon) -> bool:
    """Connects ``sock`` to the daemon; False while the listener's backlog is full."""
    try:
        sock.connect(os.fspath(daemon.socket))
    except BlockingIOError:
        return False
    return True


def answered(sock: socket.socket) -> bool:
    """Whether gRPC answered the connection's preface with its SETTINGS (so the relay relayed
    it); a refused connection is closed instead."""
    try:
        head = sock.recv(9, socket.MSG_WAITALL)
    except ConnectionResetError:
        return False
    return len(head) == 9 and head[3] == 4


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stats_through_a_new_connection(daemon: Daemon) -> pb.StatsResponse:
    channel, stub = daemon.stub()
    with channel:
        return stub.Stats(pb.StatsRequest(), timeout=60, wait_for_ready=True)


def survived(daemon: Daemon, relay: int, before: int) -> None:
    """The relay that took the flood still runs and holds no more descriptors than before it,
    and a new connection is served."""
    assert relay_pids(daemon) == [relay], daemon.log.read_text()
    wait_until(lambda: fds(relay) <= before, "the flood's descriptors closed in the relay")
    assert stats_through_a_new_connection(daemon).sessions == 0
    log = daemon.log.read_text()
    assert "relay exited" not in log and "Traceback" not in log, log


def test_a_flood_within_the_hard_limit_is_relayed_whole(room_for_a_flood):
    """At the common soft limit of 1024 descriptors a relay that spent six per connection died
    of ``EMFILE`` with every session through it; the relay raises its limit to the hard one."""
    daemon = Daemon(host_bytes=16 * BLOCK_BYTES, nofile=(COMMON_SOFT_LIMIT, room_for_a_flood))
    try:
        daemon.start()
        (relay,) = relay_pids(daemon)
        channel, stub = daemon.stub()
        with channel:
            session = open_session(stub).session_id
            before = fds(relay)
            with flood(daemon, FLOOD) as socks:
                assert all(answered(sock) for sock in socks), daemon.log.read_text()
                assert stub.Stats(pb.StatsRequest(), timeout=60).sessions == 1
                assert stats_through_a_new_connection(daemon).sessions == 1
            stub.Close(pb.SessionRequest(session_id=session), timeout=60)
        survived(daemon, relay, before)
        assert daemon.stop() == 0, daemon.log.read_text()
    finally:
        daemon.cleanup()


def test_connections_beyond_the_descriptor_limit_are_refused_and_the_rest_keep_working(
    room_for_a_flood,
):
    daemon = Daemon(host_bytes=16 * BLOCK_BYTES, nofile=(512, 512))
    try:
        daemon.start()
        (relay,) = relay_pids(daemon)
        channel, stub = daemon.stub()
        with channel:
            session = open_session(stub).session_id
            before = fds(relay)
            with flood(daemon, FLOOD) as socks:
                relayed = sum(answered(sock) for sock in socks)
                assert stub.Stats(pb.StatsRequest(), timeout=60).sessions == 1
            stub.Close(pb.SessionRequest(session_id=session), timeout=60)
        refused = FLOOD - relayed
        assert relayed > 100 and refused > 100, (relayed, daemon.log.read_text())
        log = daemon.log.read_text()
        lines = [line for line in log.splitlines() if "refused a connection" in line]
        assert 1 <= len(lines) < refused / 10, log  # a flood of refusals is not a flood of lines
        survived(daemon, relay, before)
        assert daemon.stop() == 0, daemon.log.read_text()
    finally:
        daemon.cleanup()
