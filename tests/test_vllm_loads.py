"""Loads larger than the host tier stream through it, a chunk at a time, and give their slots
back at once.

A session may hold at most half the host slots, and a hit may be several times the whole
host tier when most of it lies on disk. The worker asks for one chunk the session has room
for, copies it, releases it, then asks for the next; the fake forward pass checks every byte.
A load that never finds room gives up its remaining blocks rather than keep its request
waiting.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

pytest.importorskip("vllm")

from kvtier.connector.tunables import TUNABLES
from kvtier.connector.vllm.loads import StreamedLoad
from kvtier.connector.vllm.metadata import KVTierMetadata, LoadSpec
from kvtier.tiers.gpu.transfer import Transfer

import vllmdaemon
import vllmharness as harness
from daemonutil import Daemon, wait_until
from tinymodel import BLOCK, BLOCK_BYTES
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
make_engine = harness.make_engine

HOST_SLOTS = 8


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES, disk_bytes=1024 * BLOCK_BYTES).start()
    yield d
    d.cleanup()


def test_an_async_hit_three_times_the_host_tier_loads_whole(make_engine, daemon) -> None:
    first = make_engine(num_blocks=64)
    shared = prompt(21, 3 * HOST_SLOTS * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    assert first.stats["stored_blocks"] == 3 * HOST_SLOTS
    # The same disk tier behind a host tier a third of the hit's size.
    assert daemon.stop() == 0
    daemon.host_bytes = HOST_SLOTS * BLOCK_BYTES
    daemon.start()
    second = make_engine(num_blocks=64)
    second.add([*shared, 2, 3], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 3 * HOST_SLOTS
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= 3 * HOST_SLOTS * BLOCK  # every loaded byte was read back
    assert_scheduler_empty(second.scheduler)
    vllmdaemon.assert_daemon_holds_nothing(second, daemon)


def test_two_async_hits_asked_in_one_step_share_the_room(make_engine, daemon) -> None:
    """Each hit is bigger than the session's room: the second load must wait for the room
    the first one's acquire takes, not ask for it too and be answered short."""
    first = make_engine(num_blocks=64)
    shared = [prompt(31 + i, 3 * HOST_SLOTS // 2 * BLOCK) for i in range(2)]
    for i, tokens in enumerate(shared):
        first.add([*tokens, 1], f"a{i}")
    first.run()
    assert daemon.stop() == 0
    daemon.host_bytes = HOST_SLOTS * BLOCK_BYTES
    daemon.start()
    second = make_engine(num_blocks=64)
    for i, tokens in enumerate(shared):
        second.add([*tokens, 2], f"b{i}")
    second.run()
    assert second.stats["loaded_blocks"] == 3 * HOST_SLOTS
    assert "load_failed_blocks" not in second.stats, second.stats
    assert_scheduler_empty(second.scheduler)
    vllmdaemon.assert_daemon_holds_nothing(second, daemon)


# ---- one streamed load on its own ----
def answered(slots: list[int]) -> Future[list[int]]:
    future: Future[list[int]] = Future()
    future.set_result(slots)
    return future


class Recorder:
    def __init__(self) -> None:
        self.asked: list[int] = []
        self.copied: list[tuple[list[int], list[int]]] = []
        self.failed: list[int] = []

    def acquire(self, hashes):
        self.asked.append(len(hashes))
        return answered(list(range(100, 100 + len(hashes))))

    def copy(self, slots, block_ids):
        self.copied.append((slots, block_ids))
        return Transfer(len(slots), 0)

    def fail(self, spec, block_ids):
        self.failed += block_ids


def make_load(blocks: int) -> StreamedLoad:
    spec = LoadSpec(req_id="r", block_ids=list(range(blocks)), hashes=(), sync=False)
    return StreamedLoad(spec, [bytes([i]) * 16 for i in range(blocks)])


def test_a_load_goes_chunk_by_chunk_within_the_room():
    load, rec = make_load(5), Recorder()
    for _ in range(8):  # each chunk: one step asks, a later one copies
        load.advance(rec.acquire, rec.copy, rec.fail, room=2, chunk=4, now=0.0)
    assert rec.asked == [2, 2, 1]
    assert [ids for _, ids in rec.copied] == [[0, 1], [2, 3], [4]]
    assert load.landed and not rec.failed


def test_a_load_without_room_gives_up_its_blocks_after_a_while():
    load, rec = make_load(6), Recorder()
    load.advance(rec.acquire, rec.copy, rec.fail, room=2, chunk=4, now=0.0)
    for _ in range(3):  # the first chunk is copied; then there is no room
        load.advance(rec.acquire, rec.copy, rec.fail, room=0, chunk=4, now=1.0)
    load.advance(
        rec.acquire, rec.copy, rec.fail, room=0, chunk=4, now=1.0 + TUNABLES.starved_load_s / 2
    )
    assert not load.landed and not rec.failed  # still waiting for room
    load.advance(
        rec.acquire, rec.copy, rec.fail, room=0, chunk=4, now=1.0 + TUNABLES.starved_load_s
    )
    assert load.landed
    assert rec.failed == [2, 3, 4, 5]  # what was copied stays; vLLM recomputes the rest


def test_a_release_goes_out_while_a_commit_is_held_up(make_engine, daemon, monkeypatch) -> None:
    """A load's slots go back to the daemon at once, never queued behind a store's
    Commit (one thread used to send both: a slow commit kept every slot read since)."""
    first = make_engine(num_blocks=64)
    shared = prompt(31, 4 * BLOCK)
    first.add([*shared, 1], "stored")
    first.run()
    second = make_engine(num_blocks=64)
    side = second.worker.worker
    client = side._client(side.groups[0])
    committing, go_on = threading.Event(), threading.Event()
    commit_later = client.commit_later

    def held_commit(slots, then=None):
        committing.set()
        go_on.wait(120)
        return commit_later(slots, then)

    monkeypatch.setattr(client, "commit_later", held_commit)
    try:
        second.add([*prompt(32, 2 * BLOCK), 1], "storing")
        for _ in range(50):
            second.step()
            if committing.wait(0.1):
                break
        assert committing.is_set(), "the store never reached its commit"
        second.add([*shared, 2], "loading")
        for _ in range(50):
            if not second.step():
                side.wait_for_loads(timeout=60)
            if second.stats.get("loaded_blocks", 0) >= 4:
                break
        assert second.stats.get("loaded_blocks") == 4
        wait_until(
            lambda: vllmdaemon.daemon_stats(daemon)["acquired_slots"] == 0,
            "the loaded slots released while the commit is held up",
            timeout=30,
        )
        assert not go_on.is_set()
    finally:
        go_on.set()
    second.run()
    assert_scheduler_empty(second.scheduler)


def test_advancing_many_waiting_loads_visits_each_a_bounded_number_of_times(
    model_dir, monkeypatch
) -> None:
    """Each step advances every waiting load; how many acquires are on their way must be
    kept as it goes, not summed over every load again for each one (quadratic)."""
    waiting = 256
    roomy = Daemon(host_bytes=4 * waiting * BLOCK_BYTES, disk_bytes=0).start()
    try:
        engine = harness.Engine(roomy, model_dir, num_blocks=64)
        try:
            _many_waiting_loads(engine, waiting, monkeypatch)
        finally:
            engine.close()
    finally:
        roomy.cleanup()


def _many_waiting_loads(engine, waiting: int, monkeypatch) -> None:
    side = engine.worker.worker
    client = side._client(side.groups[0])
    go_on = threading.Event()
    acquire = client.acquire

    def held_acquire(hashes):
        go_on.wait(120)
        return acquire(hashes)

    monkeypatch.setattr(client, "acquire", held_acquire)
    engine_thread = threading.get_ident()
    looked = [0]
    done = Future.done

    def counted_done(future):
        if threading.get_ident() == engine_thread:
            looked[0] += 1
        return done(future)

    specs = [
        LoadSpec(f"r{i}", [i % 64], (bytes([i % 256, i // 256]) * 8,), sync=False)
        for i in range(waiting)
    ]
    try:
        monkeypatch.setattr(Future, "done", counted_done)
        side.start_load_kv(KVTierMetadata(loads=specs))
        side.get_finished(set())
        monkeypatch.setattr(Future, "done", done)
        assert looked[0] <= 8 * waiting, f"{looked[0]} looks at {waiting} waiting loads"
    finally:
        monkeypatch.setattr(Future, "done", done)
        go_on.set()
    side.wait_for_loads(timeout=120)
    side.get_finished(set())
    assert side.take_load_errors() == {i % 64 for i in range(waiting)}
