"""A daemon restarted under running clients, in an arena directory with room for one arena
and a bit: each client lets go of the old arena once its session is lost and nothing of its
is in flight, so the new daemon finds room for its own; a new arena is mapped and
page-locked on the client's thread before the engine can use it."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.service.arena import Arena

from daemonutil import BLOCK_BYTES, Daemon, block_hash, load, store, wait_until
from shmutil import small_tmpfs

HOST_SLOTS = 64
HOST_BYTES = HOST_SLOTS * BLOCK_BYTES
ROOM = 1.3
"""The arena directory's size, in host tiers: one arena and a bit, never two."""


@pytest.fixture
def arena_dir() -> Iterator[Path]:
    with small_tmpfs(int(ROOM * HOST_BYTES)) as where:
        yield where


@pytest.fixture
def daemon(arena_dir: Path) -> Iterator[Daemon]:
    d = Daemon(host_bytes=HOST_BYTES, extra=["--arena-dir", str(arena_dir)]).start()
    yield d
    d.stop()
    d.cleanup()


def mapped(path_part: str) -> bool:
    """Whether this process maps a file whose path holds ``path_part``."""
    with open("/proc/self/maps") as maps:
        return any(path_part in line for line in maps)


def reattached(client, sessions: int) -> bool:
    return client.sessions_opened >= sessions and client.connected


def test_a_lost_client_lets_go_of_an_arena_the_daemon_removed(daemon: Daemon):
    """Defect: the client kept the old arena mapped (and page-locked) until its next Open,
    and that Open needs the room the old arena's pages still take."""
    with daemon.client():
        assert mapped(f"kvtier-{daemon.name}")
        assert daemon.stop() == 0
        wait_until(lambda: not mapped(f"kvtier-{daemon.name}"), "the client to unmap the arena")


def test_restarts_with_room_for_one_arena_and_a_bit_keep_the_client_working(daemon: Daemon):
    """Three restarts (stopped, killed, stopped) in a directory of 1.3 host tiers: after each
    the client is reattached, stores and loads, and finds what the disk tier kept."""
    stops = (daemon.stop, lambda: daemon.kill(signal.SIGKILL), daemon.stop)
    with daemon.client() as client:
        before = [block_hash("before", i) for i in range(8)]
        assert store(client, before) == before
        for restart, stop in enumerate(stops):
            stop()
            daemon.start()
            wait_until(lambda n=restart: reattached(client, n + 2), "the client to reattach")
            fresh = [block_hash(f"after-{restart}", i) for i in range(8)]
            assert store(client, fresh) == fresh
            assert client.lookup(fresh).host == len(fresh)
            assert load(client, fresh) == fresh  # host hits
            assert load(client, before) == before  # from the disk tier


def test_a_dead_daemons_arena_counts_as_free_room(arena_dir: Path):
    """Defect: the free-space check ran before a dead daemon's leftover arena of the same
    name was replaced, so the leftover's bytes counted against the new one."""
    leftover = arena_dir / "kvtier-leftover"
    with open(leftover, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, HOST_BYTES)
    arena = Arena(leftover.name, HOST_BYTES, arena_dir)
    try:
        assert os.stat(leftover).st_size == HOST_BYTES
    finally:
        arena.close()
    assert not leftover.exists()


def test_a_new_arena_is_page_locked_on_the_clients_thread_before_it_is_used(daemon: Daemon):
    """Defect: after a restart the engine's thread unlocked the old arena and locked the new
    one on its first transfer, mid-step (seconds for tens of GiB)."""
    client = daemon.client()
    calls: list[tuple[str, str, bool, int]] = []

    def record(what: str):
        def hook(slab) -> bool:
            thread = threading.current_thread().name
            calls.append((what, thread, client.connected, slab.data_ptr()))
            return True

        return hook

    try:
        client.page_lock_with(record("lock"), record("unlock"))
        first = client.slab.data_ptr()
        assert calls == [("lock", threading.current_thread().name, True, first)]  # at start-up
        assert client.page_locked
        assert daemon.stop() == 0
        daemon.start()
        wait_until(lambda: reattached(client, 2), "the client to reattach")
        assert calls[1:] == [
            ("unlock", "kvtier-client", False, first),
            ("lock", "kvtier-client", False, client.slab.data_ptr()),  # before it is published
        ]
        assert client.page_locked
    finally:
        client.close()
    assert calls[-1] == ("unlock", threading.current_thread().name, False, calls[-2][3])
