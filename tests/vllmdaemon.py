"""The daemon side of the vLLM connector's tests (``vllmharness``): the daemon an engine talks
to, its statistics, and a flood of other blocks that pushes what it held out of its LRU."""

from __future__ import annotations

import uuid

import pytest

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.tiers.lower import NO_SPACE

from daemonutil import Daemon, daemon_stats, wait_until
from tinymodel import BLOCK, BLOCK_BYTES
from vllmharness import Engine


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES, disk_bytes=1024 * BLOCK_BYTES)
    d.start()
    yield d
    d.cleanup()


def assert_daemon_holds_nothing(engine: Engine, daemon: Daemon) -> None:
    engine.worker.worker.drain()
    stats = daemon_stats(daemon)
    assert stats["sessions"] >= 1  # our sessions are alive: the slots were handed back
    assert stats["reserved_slots"] == 0
    assert stats["acquired_slots"] == 0


def flood(engine: Engine, daemon: Daemon, blocks: int) -> None:
    """Stores ``blocks`` unrelated blocks, so the daemon's LRU drops what it held before.

    With a disk tier each committed block stays pinned in its host slot until the disk writer
    has written it, so the flood can outrun the writer and find every host slot pinned
    (``NO_SPACE``): it then waits for the writer to free slots instead of failing."""
    client = DaemonClient(
        engine.connector.scheduler.client.layout_signature,
        BLOCK_BYTES,
        block_tokens=BLOCK,
        target=daemon.target,
    )
    left = [uuid.uuid4().bytes for _ in range(blocks)]

    def store_some() -> bool:
        batch = left[:8]
        slots = client.reserve(batch)
        assert all(slot >= 0 or slot == NO_SPACE for slot in slots), slots
        taken = [slot for slot in slots if slot >= 0]
        if taken:
            assert client.commit(taken)
        left[:8] = [h for h, slot in zip(batch, slots, strict=True) if slot < 0]
        return not left

    try:
        assert client.wait_connected(30)
        wait_until(store_some, f"room in the host tier for {blocks} blocks")
    finally:
        client.close()
