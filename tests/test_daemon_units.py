"""Daemon parts without a daemon: sessions and leases, settings, the arena, a lonely client."""

from __future__ import annotations

import grpc
import pytest

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.service import config
from kvtier.service.arena import Arena, ArenaError
from kvtier.service.rpc.calls import log_source
from kvtier.service.rpc.wire import RequestError, check_slots, split_hashes
from kvtier.service.session_errors import (
    CallCancelled,
    OwnershipError,
    SessionError,
    SessionLimit,
)
from kvtier.service.sessions import ACQUIRE, RESERVE, SessionTable
from kvtier.tiers.lower import NO_SPACE


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


LAYOUT = bytes(16)


def test_sessions_own_their_slots_and_lapse():
    clock = FakeClock()
    table = SessionTable(lease_s=10, clock=clock)
    a = table.open("a", LAYOUT, 16).session_id
    b = table.open("b", LAYOUT, 16).session_id
    assert table.end_call(a, 0, RESERVE, [1, 2]) and table.end_call(b, 0, ACQUIRE, [5, 5])
    with pytest.raises(OwnershipError):
        table.take_reserved(b, [1])
    with pytest.raises(OwnershipError):
        table.take_acquired(a, [5])
    with pytest.raises(OwnershipError):
        table.take_reserved(a, [1, 1])
    table.take_acquired(b, [5])
    assert table.held() == (2, 2, 0, 1, 0)
    table.attach(b)  # b holds a keep-alive stream: it never lapses
    clock.now = 11
    ended = table.reap()
    assert [(s.session_id, left.reserved) for s, left in ended] == [(a, [1, 2])]
    with pytest.raises(SessionError):
        table.get(a)
    assert not table.end_call(a, 0, RESERVE, [3])
    left = table.detach(b)
    assert left is not None and left.acquired == [5]
    assert len(table) == 0


def test_cancel_gives_back_what_the_call_took_before_or_after_it_finished():
    table = SessionTable(lease_s=10)
    s = table.open("s", LAYOUT, 16).session_id
    # Finished, then cancelled: its slots come back, the session's others stay.
    table.begin_call(s, 1)
    assert table.end_call(s, 1, RESERVE, [3, 4])
    assert table.end_call(s, 0, RESERVE, [9])
    assert table.cancel(s, 1) == (RESERVE, [3, 4])
    assert table.get(s).reserved == {9}
    # Cancelled while running: finishing records nothing (the caller gives the slots back).
    table.begin_call(s, 2)
    assert table.cancel(s, 2) == (RESERVE, [])
    assert not table.end_call(s, 2, ACQUIRE, [5])
    assert not table.get(s).acquired
    # Cancelled before it arrived: it does not run at all.
    table.cancel(s, 3)
    with pytest.raises(CallCancelled):
        table.begin_call(s, 3)
    # An acquire's cancel gives back one read per slot it took, not the session's others.
    table.begin_call(s, 4)
    assert table.end_call(s, 4, ACQUIRE, [7])
    assert table.end_call(s, 0, ACQUIRE, [7])
    assert table.cancel(s, 4) == (ACQUIRE, [7])
    assert table.get(s).acquired == {7: 1}


def test_session_limit_and_tcp_peer_binding():
    table = SessionTable(lease_s=10, max_sessions=1)
    s = table.open("tcp", LAYOUT, 16, peer="ipv4:10.0.0.1:5000").session_id
    with pytest.raises(SessionLimit):
        table.open("another", LAYOUT, 16)
    assert table.get(s, "ipv4:10.0.0.1:5000").client_name == "tcp"
    with pytest.raises(OwnershipError, match="another connection"):
        table.get(s, "ipv4:10.0.0.2:6000")


def test_sizes_toml_and_flags(tmp_path):
    assert config.parse_size("2GiB") == 2 << 30
    assert config.parse_size("512M") == 512 << 20
    assert config.parse_size("4096") == 4096
    with pytest.raises(ValueError):
        config.parse_size("lots")
    toml = tmp_path / "kvtier.toml"
    toml.write_text('host_bytes = "64MiB"\nlease_s = 5.0\ndata_dir = "~/kv"\n')
    cfg = config.load(toml, lease_s=2.0, name=None)
    assert cfg.host_bytes == 64 << 20 and cfg.lease_s == 2.0
    assert cfg.disk_path.name == "kv" and "~" not in str(cfg.disk_path)
    toml.write_text("hostbytes = 1\n")
    with pytest.raises(ValueError, match="unknown settings"):
        config.load(toml)
    defaults = config.DaemonConfig()
    assert defaults.host_bytes == 2 << 30 and defaults.disk_bytes == 16 << 30
    assert defaults.stats_host == "127.0.0.1" and defaults.tcp is None


def test_arena_too_big_for_shm_names_the_fix(tmp_path):
    with pytest.raises(ArenaError, match="--shm-size"):
        Arena("kvtier-too-big", 1 << 60, directory=tmp_path)


def test_arena_is_private_and_exclusive(tmp_path):
    arena = Arena("kvtier-unit", 1 << 16, directory=tmp_path)
    try:
        assert arena.path.stat().st_mode & 0o777 == 0o600
        with pytest.raises(ArenaError, match="held by a running daemon"):
            Arena("kvtier-unit", 1 << 16, directory=tmp_path)
    finally:
        arena.close()
    assert not arena.path.exists()


def test_refusals_are_logged_per_host_not_per_connection():
    """A client that opens a new TCP connection per call is still one source of log lines."""
    assert log_source("ipv4:10.0.0.7:40001") == log_source("ipv4:10.0.0.7:40002")
    assert log_source("ipv6:[::1]:40001") == log_source("ipv6:[::1]:40002") == "ipv6:[::1]"
    assert log_source("ipv4:10.0.0.7:1") != log_source("ipv4:10.0.0.8:1")
    # every relayed unix connection has an address of its own; all are the daemon's own user
    assert log_source("unix:/run/.kvtier.sock.d/c1") == log_source("unix:/run/.kvtier.sock.d/c2")


def test_wire_bounds():
    assert split_hashes(bytes(32), 2) == [bytes(16), bytes(16)]
    with pytest.raises(RequestError) as info:
        split_hashes(bytes(17), 2)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RequestError) as info:
        split_hashes(bytes(48), 2)
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(RequestError):
        check_slots([7], num_slots=4, max_count=8)


def test_client_without_daemon_misses_and_never_raises(tmp_path):
    client = DaemonClient(bytes(16), 64, target=f"unix:{tmp_path}/none.sock", timeout_s=0.2)
    try:
        hashes = [bytes([i]) * 16 for i in range(3)]
        assert client.lookup(hashes).total == 0
        assert client.reserve(hashes) == [NO_SPACE] * 3
        assert client.acquire(hashes) == []
        assert client.tools.put_blocks(hashes[:1], [bytes(64)]) == 0
        assert client.tools.get_blocks(hashes) == []
        assert client.tools.stats() is None
        assert client.slab.shape == (0, 64)
        assert client.failures >= 5
        with pytest.raises(ValueError):
            client.commit([0])  # a slot it never handed out is the caller's bug
    finally:
        client.close()
