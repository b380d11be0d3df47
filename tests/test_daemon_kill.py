"""SIGKILL a client mid-store and mid-load, and the daemon under write load."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from daemonutil import BLOCK_BYTES, Daemon, block_hash, content, load, store, wait_until

HOST_SLOTS = 32


def hold(target: str, mode: str, hashes: list[bytes], ready) -> None:
    """A client that stops half-way through a store or a load and waits to be killed."""
    from kvtier.connector.client.daemon_client import DaemonClient

    from daemonutil import SIGNATURE

    client = DaemonClient(SIGNATURE, BLOCK_BYTES, target=target)
    assert client.wait_connected(60)
    if mode == "store":
        slots = client.reserve(hashes)
        assert all(s >= 0 for s in slots)
        half = BLOCK_BYTES // 2
        client.slab[slots[0]].numpy()[:half] = content(hashes[0])[:half]
    else:
        assert len(client.acquire(hashes)) == len(hashes)
    ready.set()
    time.sleep(600)


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=HOST_SLOTS * BLOCK_BYTES).start()
    yield d
    d.cleanup()


@pytest.mark.parametrize("mode", ["store", "load"])
def test_client_killed_mid_transfer_leaks_nothing(daemon, mode):
    client = daemon.client()
    hashes = [block_hash(f"kill-{mode}", i) for i in range(8)]
    if mode == "load":
        assert store(client, hashes) == hashes
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=hold, args=(daemon.target, mode, hashes, ready), daemon=True)
    victim.start()
    assert ready.wait(90), "the victim never got its slots"
    held = daemon.stats()
    assert (held.reserved_slots, held.acquired_slots) == ((8, 0) if mode == "store" else (0, 8))
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    wait_until(lambda: daemon.stats().sessions == 1, "the victim's session to end")
    after = daemon.stats()
    assert (after.reserved_slots, after.acquired_slots) == (0, 0)
    if mode == "store":
        # nothing half-written is readable, and the hashes can be stored again
        assert client.lookup(hashes).total == 0
        assert client.acquire(hashes) == []
        assert store(client, hashes) == hashes
    assert load(client, hashes) == hashes
    # every slot is free or evictable once the disk writes are done: a full arena of new
    # blocks finds room (in two sessions, as one may hold at most half of the slots)
    wait_until(lambda: writing_behind(daemon) == 0, "the disk writer to catch up")
    other = daemon.client()
    for who, half in ((client, 0), (other, 1)):
        fresh = [block_hash(f"fill-{mode}-{half}", i) for i in range(HOST_SLOTS // 2)]
        assert all(s >= 0 for s in who.reserve(fresh))
    other.close()
    client.close()
    assert daemon.stop() == 0


def write_load(target: str, index: int, log_path: str, go, idle) -> None:
    """Stores batches while ``go`` is set (``idle`` says it waits), logging each batch once
    its commit has returned.

    A batch the full host tier has no room for (every slot is being written to disk) is
    dropped and tried again with new hashes, as an engine would go on without storing.
    """
    from kvtier.connector.client.daemon_client import DaemonClient

    from daemonutil import SIGNATURE

    client = DaemonClient(SIGNATURE, BLOCK_BYTES, target=target, timeout_s=5)
    assert client.wait_connected(60)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for batch in range(10**6):
        if not go.is_set():
            idle.set()
            go.wait()
            idle.clear()
        hashes = [block_hash(f"load{index}", batch * 4 + i) for i in range(4)]
        slots = client.reserve(hashes)
        taken = [(h, s) for h, s in zip(hashes, slots, strict=True) if s >= 0]
        for h, s in taken:
            client.slab[s].numpy()[:] = content(h)
        if client.commit([s for _, s in taken]):
            os.write(fd, b"".join(h.hex().encode() + b"\n" for h, _ in taken))


def committed(paths: list[Path]) -> list[bytes]:
    out = []
    for path in paths:
        if path.exists():
            out += [
                bytes.fromhex(line)
                for line in path.read_text().splitlines(keepends=True)
                if line.endswith("\n")
            ]
    return out


def writing_behind(d: Daemon) -> int:
    return sum(layout.writing_behind for layout in d.stats().layouts)


def test_daemon_killed_under_write_load_serves_nothing_wrong_and_keeps_the_flushed():
    """The promise after a SIGKILL: nothing torn or wrong is served, and every block whose
    disk write had finished (all of them, ``flush_interval`` after their commit) is kept.

    The writers pause once, until the daemon reports no write behind in flight: everything
    committed by then must survive. They resume and the daemon is killed with writes in
    flight: of those, whatever is found must be exact.
    """
    d = Daemon(host_bytes=HOST_SLOTS * BLOCK_BYTES).start()
    try:
        logs = [d.root / f"writer{i}.log" for i in range(2)]
        ctx = multiprocessing.get_context("spawn")
        go = ctx.Event()
        go.set()
        idle = [ctx.Event() for _ in logs]
        writers = [
            ctx.Process(
                target=write_load, args=(d.target, i, str(logs[i]), go, idle[i]), daemon=True
            )
            for i in range(2)
        ]
        for w in writers:
            w.start()
        wait_until(lambda: len(committed(logs)) >= 160, "writers to commit 160 blocks", 90)
        go.clear()
        wait_until(lambda: all(e.is_set() for e in idle), "the writers to pause")
        wait_until(lambda: writing_behind(d) == 0, "the disk writer to catch up", 60)
        flushed = committed(logs)
        go.set()
        wait_until(lambda: len(committed(logs)) >= len(flushed) + 80, "80 more commits", 90)
        d.kill(signal.SIGKILL)
        for w in writers:
            w.kill()
            w.join(30)
        everything = committed(logs)
        d.proc = None
        d.start()  # same name, socket and data dir: replaces the dead daemon's arena
        client = d.client()
        for i in range(0, len(flushed), 16):
            chunk = flushed[i : i + 16]
            assert load(client, chunk) == chunk, f"lost flushed blocks after {i}"
        later = everything[len(flushed) :]
        found = sum(len(load(client, [h])) for h in later)  # load() checks every byte
        assert client.failures == 0
        client.close()
        assert d.stop() == 0
        print(f"{len(flushed)} flushed blocks all kept; {found} of {len(later)} in flight kept")
    finally:
        d.cleanup()
