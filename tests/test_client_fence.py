"""A copy of a client whose session was lost never lands in a slot another session owns.

An engine paused for longer than any timer (a weight update, sleep mode, a slow step) may
finish a store it queued before its keep-alive stream broke. Its slot stays fenced until the
client reopens naming the session (it does so only once nothing of its is in flight) or its
process is gone, so the late bytes land in a slot nobody reads.
"""

from __future__ import annotations

import mmap
import time

import pytest

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb

from daemonutil import BLOCK_BYTES, SIGNATURE, Daemon, block_hash, load, store, wait_until

HOST_SLOTS = 4
PAUSE_S = 12.0
"""How long the engine with the late copy is paused: longer than a 10 s hold, so that the test
fails wherever a lost session's slots are freed by a timer rather than fenced."""


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=HOST_SLOTS * BLOCK_BYTES, disk_bytes=0, lease_s=2.0).start()
    yield d
    d.stop()  # the daemon removes its arena
    d.cleanup()


def quarantined(daemon: Daemon) -> int:
    return daemon.stats().quarantined_slots


def test_a_late_copy_of_a_lost_session_never_reaches_another_sessions_block(daemon):
    """Defect: B's block read back as A's late 0xAA bytes."""
    channel, stub = daemon.stub()
    with channel:
        opened = stub.Open(
            pb.OpenRequest(
                client_name="engine-a",
                layout_signature=SIGNATURE,
                block_bytes=BLOCK_BYTES,
                block_tokens=16,
                protocol_version=contract.PROTOCOL_VERSION,
            ),
            timeout=10,
        )
        keepalive = stub.KeepAlive(pb.SessionRequest(session_id=opened.session_id))
        next(keepalive)  # attached: the session lives as long as this stream
        reply = stub.Reserve(
            pb.ReserveRequest(
                session_id=opened.session_id, hashes=block_hash("late", 0), call_id=1
            ),
            timeout=10,
        )
        (slot,) = reply.slots
        assert slot >= 0
        with open(opened.arena_path, "r+b") as f:
            arena = mmap.mmap(f.fileno(), opened.arena_bytes)
        keepalive.cancel()  # the stream breaks while A's store is queued
        wait_until(lambda: quarantined(daemon) == 1, "the daemon to fence A's slot")
        time.sleep(PAUSE_S)  # A's engine is paused

        with arena, daemon.client() as b:
            stored: list[bytes] = []
            for i in range(2 * HOST_SLOTS):  # one block at a time, through every slot B gets
                stored += store(b, [block_hash("b", i)])
            assert len(stored) == 2 * HOST_SLOTS
            arena[slot * BLOCK_BYTES : (slot + 1) * BLOCK_BYTES] = b"\xaa" * BLOCK_BYTES  # A wakes
            held = [h for h in stored if b.lookup([h]).host]
            for h in held:  # exact: none of them is in A's slot
                assert load(b, [h]) == [h]
            assert len(held) == HOST_SLOTS - 1  # every slot but A's fenced one
            assert quarantined(daemon) == 1

        # A's client reopens naming the lost session: nothing of A's is in flight any more.
        stub.Open(
            pb.OpenRequest(
                client_name="engine-a",
                layout_signature=SIGNATURE,
                block_bytes=BLOCK_BYTES,
                block_tokens=16,
                protocol_version=contract.PROTOCOL_VERSION,
                lost_sessions=[opened.session_id],
            ),
            timeout=10,
        )
        assert quarantined(daemon) == 0


def test_a_client_names_its_lost_session_when_it_reopens(daemon):
    """The client reopens only once it holds no slot of the lost session, and its Open frees
    that session's fenced slots at once (no timer)."""
    with daemon.client() as client:
        held = block_hash("held", 0)
        (slot,) = client.reserve([held])
        assert slot >= 0
        keeper = client._keeper
        keeper.give_up(keeper.session, "the test breaks the session")
        wait_until(lambda: quarantined(daemon) == 1, "the daemon to fence the reserved slot")
        assert not client.wait_connected(0.5)  # the slot is still held here: no new session
        client.abort([slot])  # its copy never started
        assert client.wait_connected(60)
        assert quarantined(daemon) == 0  # the Open that reattached the client freed it
        assert store(client, [held]) == [held]
        assert load(client, [held]) == [held]
