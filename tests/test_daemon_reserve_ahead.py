"""Slots reserved ahead of the stores (``DaemonClient(reserve_ahead=True)``), against a real
daemon: a store reserves without a call and its Commit names the slots; a block stored
already is copied but stored once, or not copied where the client reads the lookup index; a
lost session's spare slots come back and the client reconnects; a Commit that names its slots
wrongly is refused and leaks nothing; one sent without waiting to a daemon gone is a counted
failure that leaves nothing waiting."""

from __future__ import annotations

import grpc
import pytest

from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.lower import ALREADY_STORED

from daemonutil import (
    BLOCK_BYTES,
    Daemon,
    block_hash,
    content,
    load,
    open_session,
    store,
    wait_until,
)

AHEAD = 16


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(host_bytes=32 * AHEAD * BLOCK_BYTES, extra=["--reserve-ahead-blocks", str(AHEAD)])
    d.start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def reserved_ahead(client, tag: str) -> None:
    """Stores one block (by hash: nothing is reserved ahead yet), then waits for the slots it
    asked for ahead to come."""
    assert store(client, [block_hash(tag, -1)]) == [block_hash(tag, -1)]
    wait_until(lambda: len(client._stores.ahead) == AHEAD, "slots reserved ahead")


def test_a_store_takes_slots_reserved_ahead_and_its_commit_names_them(daemon):
    with daemon.client(reserve_ahead=True) as client:
        reserved_ahead(client, "ahead")
        blocks = [block_hash("ahead", i) for i in range(AHEAD // 4)]  # leaves half: no refill
        sent = client.slot_calls.streamed
        slots = client.reserve(blocks, [b"m%d" % i for i in range(len(blocks))])
        assert client.slot_calls.streamed == sent  # no Reserve went out
        assert sorted(slots) == sorted(set(slots)) and min(slots) >= 0
        for h, slot in zip(blocks, slots, strict=True):
            client.slab[slot].numpy()[:] = content(h)
        held = daemon.stats()  # until the Commit names them, they are the daemon's unnamed
        assert (held.reserved_slots, held.reserved_ahead_slots) == (0, AHEAD)
        assert client.commit(slots)
        assert load(client, blocks) == blocks
        assert client.lookup(blocks).host == len(blocks)


def test_a_block_stored_already_is_copied_but_stored_once(daemon):
    with daemon.client() as other, daemon.client(reserve_ahead=True) as client:
        blocks = [block_hash("twice", i) for i in range(3)]
        assert store(other, blocks[:2]) == blocks[:2]
        reserved_ahead(client, "twice")
        slots = client.reserve(blocks)
        assert min(slots) >= 0  # reserved ahead: the client cannot know they are stored
        for slot in slots[:2]:
            client.slab[slot].numpy()[:] = 7  # not what is stored: must not replace it
        client.slab[slots[2]].numpy()[:] = content(blocks[2])
        answers = []
        client.commit_later(slots, lambda ok, not_stored: answers.append((ok, not_stored)))
        wait_until(lambda: answers, "the commit's answer")
        assert answers == [(True, 2)]
        assert client.counters.blocks_deduplicated == 2
        assert load(client, blocks) == blocks


def test_a_lost_session_gives_its_spare_slots_back_and_the_client_reconnects(daemon):
    with daemon.client(reserve_ahead=True) as client:
        reserved_ahead(client, "lost")
        client._keeper.give_up(client._keeper.session, "a test gives the session up")
        # the spare slots are the client's own: the keeper need not wait for them
        wait_until(lambda: client.sessions_opened == 2 and client.connected, "a new session")
        assert len(client._stores.ahead) == 0
        blocks = [block_hash("lost", i) for i in range(4)]
        assert store(client, blocks) == blocks
        assert load(client, blocks) == blocks
    wait_until(lambda: daemon.stats().sessions == 0, "the sessions closed")
    held = daemon.stats()
    assert (held.reserved_slots, held.acquired_slots) == (0, 0), held


def test_a_commit_that_names_its_slots_wrongly_is_refused_and_leaks_nothing(daemon):
    channel, stub = daemon.stub()
    with channel:
        session = open_session(stub).session_id
        try:
            reply = stub.Reserve(pb.ReserveRequest(session_id=session, unnamed=3), timeout=10)
            slots = list(reply.slots)
            assert len(slots) == 3
            with pytest.raises(grpc.RpcError) as refused:  # two hashes for three slots
                stub.Commit(
                    pb.SlotsRequest(session_id=session, slots=slots, hashes=bytes(32)), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:  # unnamed slots need their hashes
                stub.Commit(pb.SlotsRequest(session_id=session, slots=slots), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:  # they were aborted with that Commit
                stub.Abort(pb.SlotsRequest(session_id=session, slots=slots), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            both = pb.ReserveRequest(session_id=session, unnamed=1, hashes=bytes(16))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Reserve(both, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            stub.Close(pb.SessionRequest(session_id=session), timeout=10)
    held = daemon.stats()
    assert held.reserved_slots == 0, held


def test_a_client_reading_the_index_copies_no_block_it_says_is_stored(daemon):
    with (
        daemon.client() as other,
        daemon.client(reserve_ahead=True, lookup_index=True) as client,
    ):
        blocks = [block_hash("indexed", i) for i in range(4)]
        assert store(other, blocks[1:3]) == blocks[1:3]
        reserved_ahead(client, "indexed")
        slots = client.reserve(blocks)
        assert [s == ALREADY_STORED for s in slots] == [False, True, True, False]
        assert len(client._stores.ahead) == AHEAD - 2  # the stored ones took no slot
        for h, slot in zip(blocks[::3], slots[::3], strict=True):
            client.slab[slot].numpy()[:] = content(h)
        assert client.commit(slots[::3])
        assert load(client, blocks) == blocks


def test_a_commit_sent_without_waiting_to_a_daemon_gone_is_a_counted_failure():
    gone = Daemon(host_bytes=32 * AHEAD * BLOCK_BYTES, extra=["--reserve-ahead-blocks", str(AHEAD)])
    gone.start()
    try:
        with gone.client(reserve_ahead=True) as client:
            reserved_ahead(client, "gone")
            slots = client.reserve([block_hash("gone", i) for i in range(4)])
            gone.kill()
            answers = []
            client.commit_later(slots, lambda ok, not_stored: answers.append((ok, not_stored)))
            wait_until(lambda: answers, "the commit's answer")
            assert answers == [(False, 0)]
            assert client.failures >= 1
            assert client.settle(30)  # nothing left waiting on the daemon that went
    finally:
        gone.cleanup()
