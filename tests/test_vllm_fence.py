"""The worker drops a copy whose session was lost before the copy started.

The slots a copy goes through belong to the client's session that handed them out. When that
session is lost between the daemon's answer and the copy's start (an engine paused, a stream
broken), the daemon fences the slots until the client opens its next session, which it does
only once every slot of the old one is handed back. A store into them could never be
committed and a load out of them may read a slot the daemon has since given away: the worker
hands the slots back unused (the store fails, the load's blocks are recomputed), and the
client's next session frees them on the daemon at once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.connector.client.daemon_client import DaemonClient

import vllmdaemon
import vllmharness as harness
from daemonutil import Daemon, wait_until
from tinymodel import BLOCK, BLOCK_BYTES
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
make_engine = harness.make_engine


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES, disk_bytes=1024 * BLOCK_BYTES).start()
    yield d
    d.stop()
    d.cleanup()


def record_copies(copy_engine, method: str, client: DaemonClient, monkeypatch) -> list[bool]:
    """Whether the client held a session at each copy ``copy_engine`` started."""
    seen: list[bool] = []
    copy = getattr(copy_engine, method)

    def recorded(*args, **kwargs):
        seen.append(client.connected)
        return copy(*args, **kwargs)

    monkeypatch.setattr(copy_engine, method, recorded)
    return seen


def lose_session(client: DaemonClient) -> None:
    keeper = client._keeper
    keeper.give_up(keeper.session, "the test breaks the session after the daemon answered")


def settled(daemon: Daemon, client: DaemonClient, sessions: int) -> bool:
    """The client holds a new session and the daemon holds nothing of the lost one."""
    stats = vllmdaemon.daemon_stats(daemon)
    return (
        client.sessions_opened >= sessions
        and client.connected
        and stats["quarantined_slots"] == 0
        and stats["reserved_slots"] == 0
        and stats["acquired_slots"] == 0
    )


def test_a_store_reserved_by_a_lost_session_is_not_copied(make_engine, daemon, monkeypatch):
    engine = make_engine()
    side = engine.worker.worker
    client = side._client(side.groups[0])
    copies = record_copies(side.engines[0], "store", client, monkeypatch)
    reserve = client.reserve

    def reserve_then_lose(hashes, metas=None):
        slots = reserve(hashes, metas)
        if client.sessions_opened == 1:
            lose_session(client)
        return slots

    monkeypatch.setattr(client, "reserve", reserve_then_lose)
    side._deferred[0]._reserve = client.reserve
    engine.add([*prompt(41, 4 * BLOCK), 1], "lost")
    engine.run()
    assert engine.stats["store_failed_blocks"] == 4
    assert "stored_blocks" not in engine.stats
    assert copies == []  # no copy into the lost session's slots
    wait_until(lambda: settled(daemon, client, 2), "the client to reopen and free the slots")
    assert_scheduler_empty(engine.scheduler)


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_a_load_acquired_by_a_lost_session_is_recomputed(
    make_engine, daemon, load_async, monkeypatch
):
    first = make_engine(load_async=load_async)
    shared = prompt(42, 4 * BLOCK)
    first.add([*shared, 1], "stored")
    first.run()
    assert first.stats["stored_blocks"] == 4

    second = make_engine(load_async=load_async)
    side = second.worker.worker
    client = side._client(side.groups[0])
    copies = record_copies(side.engines[0], "load", client, monkeypatch)
    acquire = client.acquire

    def acquire_then_lose(hashes):
        slots = acquire(hashes)
        if client.sessions_opened == 1:
            lose_session(client)
        return slots

    monkeypatch.setattr(client, "acquire", acquire_then_lose)
    second.add([*shared, 2, 3], "loading")
    second.run()
    assert all(copies)  # nothing copied out of the lost session's slots
    assert second.stats["load_failed_blocks"] >= 4
    assert second.checked_tokens >= 4 * BLOCK  # every byte checked, loaded or recomputed
    wait_until(lambda: settled(daemon, client, 2), "the client to reopen and free the slots")
    assert_scheduler_empty(second.scheduler)
