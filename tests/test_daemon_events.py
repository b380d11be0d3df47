"""A watcher too slow for the daemon's events is told so, and watches again with a replay.

A real daemon whose disk tier holds a couple of thousand blocks: a watcher asks for a replay,
reads its first batch and no more, while another client stores enough blocks that the
watcher's queue in the daemon (8,192 events) overflows. Its stream must then end with the
status that says events were lost, and a new watch with replay must show exactly what the
tiers hold.
"""

from __future__ import annotations

import grpc
import pytest

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

from daemonutil import BLOCK_BYTES, SIGNATURE, Daemon, block_hash, store, wait_until

HOST_SLOTS = 64
ON_DISK = 2048
# Each new block is three events (stored in the host tier, an older one evicted from it,
# stored on disk): past the 8,192 a watcher's queue holds.
NEW = 3200
WAIT_S = 120.0


@pytest.fixture
def daemon():
    d = Daemon(
        host_bytes=HOST_SLOTS * BLOCK_BYTES,
        disk_bytes=2 * (ON_DISK + NEW) * BLOCK_BYTES,
        extra=["--no-disk-sync", "--flush-interval-s", "0.05"],
    ).start()
    yield d
    d.cleanup()


def store_all(client, hashes: list[bytes]) -> None:
    """Stores every block, a session's share of the host slots at a time, waiting for room
    while the slots are pinned by their writes to disk."""
    share = HOST_SLOTS // 2
    for i in range(0, len(hashes), share):
        pending = hashes[i : i + share]

        def stored_the_rest() -> bool:
            nonlocal pending
            done = set(store(client, pending))
            pending = [h for h in pending if h not in done]
            return not pending

        wait_until(stored_the_rest, "room in the host tier", WAIT_S)


def disk_tier(daemon: Daemon) -> pb.TierStats:
    return next(t for t in daemon.stats().tiers if t.tier == "disk")


def watch(stub: pb_grpc.KvTierStub):
    request = pb.WatchRequest(layout_signature=SIGNATURE, replay=True)
    return stub.WatchEvents(request, timeout=WAIT_S)


def replayed(stub: pb_grpc.KvTierStub) -> dict[str, set[bytes]]:
    """What a new watch's replay says each tier holds."""
    view: dict[str, set[bytes]] = {"host": set(), "disk": set()}
    stream = watch(stub)
    try:
        for batch in stream:
            for event in batch.events:
                assert event.kind == pb.BlockEvent.STORED
                view[event.tier].add(event.hash)
            if batch.replay_done:
                return view
    finally:
        stream.cancel()
    raise AssertionError("the replay never finished")


def test_a_watcher_that_falls_behind_a_replay_is_told_and_watches_again(daemon):
    client = daemon.client(client_name="writer")
    old = [block_hash("on-disk", i) for i in range(ON_DISK)]
    store_all(client, old)
    wait_until(lambda: disk_tier(daemon).used_blocks == ON_DISK, "the disk writes", WAIT_S)
    # No window growth: the daemon must find this watcher slow, whatever the machine.
    options = [*contract.CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(daemon.target, options=options)
    stub = pb_grpc.KvTierStub(channel)
    with channel:
        slow = watch(stub)
        first = next(slow)  # the replay has begun; the watcher reads nothing more for now
        assert first.events
        new = [block_hash("new", i) for i in range(NEW)]
        store_all(client, new)
        wait_until(lambda: daemon.stats().events_dropped > 0, "the watcher's queue to overflow")
        with pytest.raises(grpc.RpcError) as ended:
            for _ in slow:
                pass
        assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value
        assert ended.value.details().startswith(contract.EVENTS_LOST), ended.value.details()

        everything = set(old + new)
        wait_until(
            lambda: (
                disk_tier(daemon).used_blocks == len(everything)
                and not daemon.stats().layouts[0].writing_behind
            ),
            "the disk writes",
            WAIT_S,
        )
        in_host = {h for h in everything if client.lookup([h]).host}
        assert len(in_host) == HOST_SLOTS
        assert replayed(stub) == {"host": in_host, "disk": everything}
    client.close()
