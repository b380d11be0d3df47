"""One client cannot starve the others, a disk tier that cannot open costs only the disk
and a disk write in flight never changes what a lookup promises: slot shares,
disk faults and write-behind on the daemon's own ``Daemon`` object in process; the watcher cap
and per-method request bounds on a real ``kvtier serve``."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import grpc
import lmdb
import pytest

from kvtier.bench.redis_server import RedisProcess
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import PROTOCOL_VERSION, pid_namespace
from kvtier.service import layout_store
from kvtier.service.config import DaemonConfig
from kvtier.service.daemon import Daemon
from kvtier.service.events import EventHub
from kvtier.service.rpc.servicer import KvTierServicer
from kvtier.service.stats.metrics import Metrics
from kvtier.service.store import BlockStore
from kvtier.tiers.disk import writer as disk_writer
from kvtier.tiers.lower import NO_SPACE

from daemonutil import Daemon as DaemonProcess
from daemonutil import block_hash, daemon_name, open_session, store, wait_until

BLOCK = 4096
LAYOUT = b"q" * 16


@pytest.fixture
def make_daemon():
    made: list[tuple[Daemon, asyncio.AbstractEventLoop]] = []

    def make(**config) -> Daemon:
        cfg = DaemonConfig(name=daemon_name(), **config)
        loop = asyncio.new_event_loop()
        daemon = Daemon(cfg, BlockStore(cfg, EventHub(loop)))
        made.append((daemon, loop))
        return daemon

    yield make
    for daemon, loop in made:
        daemon.shutdown()
        loop.close()


def session(daemon: Daemon, name: str) -> str:
    opened = daemon.open(
        name,
        LAYOUT,
        BLOCK,
        16,
        PROTOCOL_VERSION,
        client_pid=os.getpid(),
        client_pid_ns=pid_namespace(),
    )
    daemon.attach(opened.session.session_id)
    return opened.session.session_id


def hashes(tag: bytes, n: int) -> list[bytes]:
    return [tag + bytes([i]) * 15 for i in range(n)]


def test_a_session_reserves_and_acquires_only_its_share(make_daemon) -> None:
    daemon = make_daemon(host_bytes=8 * BLOCK, disk_bytes=0)  # a share of 0.5: 4 slots
    greedy, other = session(daemon, "greedy"), session(daemon, "other")
    blocks = hashes(b"a", 8)
    slots = daemon.reserve(greedy, blocks)
    assert all(slot >= 0 for slot in slots[:4])
    assert slots[4:] == [NO_SPACE] * 4
    theirs = daemon.reserve(other, blocks[4:])  # the rest of the host tier is still free
    assert all(slot >= 0 for slot in theirs)
    daemon.commit(greedy, slots[:4])
    daemon.commit(other, theirs)
    # Every block is readable, but one session reads at most its share at once: a shorter hit.
    mine, _ = daemon.acquire(greedy, blocks)
    assert len(mine) == 4
    assert len(daemon.acquire(other, blocks)[0]) == 4
    daemon.release(greedy, mine)
    assert len(daemon.acquire(greedy, blocks)[0]) == 4


@pytest.mark.parametrize(
    "error",
    [
        lmdb.DiskError("mdb_env_open: No space left on device"),
        lmdb.MapFullError("mdb_put: MDB_MAP_FULL"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["lmdb-disk-error", "lmdb-map-full", "enospc"],
)
def test_a_disk_tier_that_cannot_open_leaves_the_layout_host_only(
    make_daemon, tmp_path, monkeypatch, error
) -> None:
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(layout_store, "DiskTier", refuse)
    daemon = make_daemon(host_bytes=8 * BLOCK, disk_bytes=64 * BLOCK, data_dir=tmp_path)
    sid = session(daemon, "c")  # the Open succeeds: the layout serves from its host tier
    blocks = hashes(b"d", 2)
    slots = daemon.reserve(sid, blocks)
    daemon.commit(sid, slots)
    assert daemon.lookup(sid, blocks).host == 2
    (layout,) = daemon.stats()["layouts"]
    assert layout["disk"].startswith("unavailable: ")
    assert daemon.store.get(LAYOUT).disk is None


def test_a_new_layouts_files_are_private_and_its_empty_disk_tier_is_reported(
    make_daemon, tmp_path
) -> None:
    daemon = make_daemon(host_bytes=8 * BLOCK, disk_bytes=64 * BLOCK, data_dir=tmp_path)
    session(daemon, "c")
    layout_dir = tmp_path / LAYOUT.hex()
    assert layout_dir.stat().st_mode & 0o777 == 0o700
    assert (layout_dir / "namespace.json").stat().st_mode & 0o777 == 0o600
    stats = daemon.stats()
    (disk,) = [tier for tier in stats["tiers"] if tier["tier"] == "disk"]
    assert disk["used_blocks"] == 0
    assert disk["capacity_blocks"] > 0
    (layout,) = stats["layouts"]
    assert layout["disk"] == "ok"
    assert layout["quarantined_slots"] == 0


def test_a_block_whose_disk_write_is_in_flight_is_a_host_hit(make_daemon, tmp_path, monkeypatch):
    """A commit is readable at once, its disk write behind it; while that write is
    in flight Lookup answers a host hit, and Acquire delivers it from the host tier (the disk
    tier used to be written first, and a Lookup then promised a disk hit Acquire refused)."""
    writing, go_on = threading.Event(), threading.Event()
    process = disk_writer.DiskWriter._process

    def held_process(self, batch, sealed):
        writing.set()
        go_on.wait(60)
        process(self, batch, sealed)

    monkeypatch.setattr(disk_writer.DiskWriter, "_process", held_process)
    daemon = make_daemon(host_bytes=8 * BLOCK, disk_bytes=64 * BLOCK, data_dir=tmp_path)
    sid = session(daemon, "c")
    try:
        blocks = hashes(b"w", 2)
        daemon.commit(sid, daemon.reserve(sid, blocks))
        assert writing.wait(30)
        (layout,) = daemon.stats()["layouts"]
        assert layout["writing_behind"] == 2
        hits = daemon.lookup(sid, blocks)
        assert (hits.host, hits.disk) == (2, 0)
        slots, sources = daemon.acquire(sid, blocks)
        assert len(slots) == 2
        assert (sources.host, sources.disk) == (2, 0)
        daemon.release(sid, slots)
    finally:
        go_on.set()
    wait_until(lambda: daemon.stats()["layouts"][0]["writing_behind"] == 0, "the writes done")


def test_an_acquire_of_host_hits_never_waits_for_a_worker_thread(make_daemon, tmp_path):
    """Worker threads serve what may read the disk or the network, and a slow disk or store can
    keep them all busy: an Acquire of host hits alone is answered on the event loop itself,
    one that must promote a disk hit on a worker thread."""
    daemon = make_daemon(host_bytes=8 * BLOCK, disk_bytes=64 * BLOCK, data_dir=tmp_path)
    sid = session(daemon, "c")
    on_disk, in_host = hashes(b"d", 4), hashes(b"h", 4)
    for blocks in (on_disk, hashes(b"f", 4), in_host):  # the last evicts the first, written down
        daemon.commit(sid, daemon.reserve(sid, blocks))
        wait_until(lambda: daemon.stats()["layouts"][0]["writing_behind"] == 0, "the writes")
    assert daemon.lookup(sid, on_disk + in_host).disk == 4
    threads = []
    acquire = daemon.acquire

    def noting_thread(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return acquire(*args, **kwargs)

    daemon.acquire = noting_thread
    servicer = KvTierServicer(daemon, daemon.events, Metrics(daemon.stats), asyncio.Event())

    async def acquire_and_release(blocks: list[bytes]) -> int:
        request = pb.AcquireRequest(session_id=sid, hashes=b"".join(blocks))
        answer = await servicer.acquire(request, "")
        await servicer.release(pb.SlotsRequest(session_id=sid, slots=answer.slots), "")
        return answer.host

    try:
        assert asyncio.run(acquire_and_release(in_host)) == 4
        assert threads == [threading.current_thread().name]
        threads.clear()
        assert asyncio.run(acquire_and_release(on_disk[:1])) == 0
        assert len(threads) == 2 and threads[1].startswith("kvtier-rpc"), threads
    finally:
        servicer.close()


@pytest.fixture
def served():
    daemon = DaemonProcess(extra=["--max-watchers", "2"]).start()
    yield daemon
    daemon.cleanup()


def test_watchers_beyond_the_cap_are_refused(served) -> None:
    channel, stub = served.stub()
    with channel:
        watching = [stub.WatchEvents(pb.WatchRequest()) for _ in range(2)]
        wait_until(lambda: served.stats().watchers == 2, "two watchers")
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.WatchEvents(pb.WatchRequest()))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in watching:
            call.cancel()
        wait_until(lambda: served.stats().watchers == 0, "the watchers gone")
        # A place freed is a place taken again.
        again = stub.WatchEvents(pb.WatchRequest())
        wait_until(lambda: served.stats().watchers == 1, "a new watcher")
        again.cancel()


@pytest.mark.parametrize(
    ("method", "size"),
    [("Stats", 100 << 10), ("Lookup", 2 << 20), ("Release", 1 << 20)],
)
def test_a_request_over_its_methods_bound_is_refused_before_decoding(
    served, method: str, size: int
) -> None:
    channel, _ = served.stub()
    with channel:
        call = channel.unary_unary(f"/kvtier.v1.KvTier/{method}")  # bytes as they are
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\x0a" + b"\xff" * (size - 1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert method in refused.value.details()
    assert served.stats().sessions == 0  # and the daemon serves on


def test_a_small_lookup_is_answered_while_a_heavy_one_waits_for_the_store() -> None:
    """Heavy calls run on worker threads: while a 2,000-hash Lookup waits for a frozen remote
    store, a small Lookup of host hits (which never asks the store) is answered at once."""
    with RedisProcess() as server:
        extra = ["--remote", server.url, "--remote-lookup-timeout-s", "30"]
        daemon = DaemonProcess(extra=extra).start()
        try:
            client = daemon.client(client_name="owner")
            held = [block_hash("small", i) for i in range(4)]
            assert store(client, held) == held
            channel, stub = daemon.stub()
            with channel:
                sid = open_session(stub).session_id
                misses = b"".join(block_hash("heavy", i) for i in range(2000))
                server.pause()
                heavy = stub.Lookup.future(
                    pb.LookupRequest(session_id=sid, hashes=misses), timeout=60
                )
                time.sleep(0.5)  # let it reach the store (not a timing assertion)
                small = stub.Lookup(
                    pb.LookupRequest(session_id=sid, hashes=b"".join(held)), timeout=20
                )
                assert small.host == len(held)
                assert not heavy.done()
                server.resume()
                assert heavy.result().host == 0
            client.close()
        finally:
            daemon.cleanup()
