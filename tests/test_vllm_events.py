"""kvtier's tiers in vLLM's KV event stream, read the way a cache-aware router reads it.

Each engine is the harness's (vLLM's real ``Scheduler`` and ``KVTierConnector`` over a
real daemon) with ``kv_events_config`` on, so vLLM's own ``ZmqEventPublisher`` sends the
batches. ``eventutil.Router`` reads them as a router does and keeps the block hashes each
medium holds; the hashes expected are computed from token ids with vLLM's algorithm and seed.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_events.py``.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

import kvtier.connector.client.daemon_client as client_module
import kvtier.connector.vllm.events as events_module
import kvtier.connector.vllm.scheduler as scheduler_module
from kvtier.proto import kvtier_pb2 as pb

import vllmharness as harness
from daemonutil import BLOCK_BYTES as RAW_BLOCK_BYTES
from daemonutil import SIGNATURE, Daemon, block_hash, content, free_port, wait_until
from eventutil import Router, events_config, router_hashes
from tinymodel import BLOCK, BLOCK_BYTES
from vllmdaemon import flood
from vllmharness import Engine, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
WAIT_S = 60.0


class EventEngine(Engine):
    """The harness's engine with vLLM's ZMQ event publisher on."""

    def __init__(self, daemon: Daemon, model_dir, monkeypatch, **extra):
        port, replay = free_port(), free_port()
        make_config = harness.make_vllm_config

        def with_events(*args):
            config = make_config(*args)
            config.kv_events_config = KVEventsConfig(**events_config(port, replay))
            return config

        with monkeypatch.context() as patch:
            patch.setattr(harness, "make_vllm_config", with_events)
            super().__init__(daemon, model_dir, **extra)
        self.router = Router(port, replay)

    def until(self, condition, what: str) -> None:
        """Steps (vLLM publishes at the end of each step) until the router sees
        ``condition``; fails after ``WAIT_S``."""
        deadline = time.monotonic() + WAIT_S
        while True:
            self.step()
            self.router.sync()
            if condition(self.router):
                return
            assert time.monotonic() < deadline, f"the router never saw {what}"
            time.sleep(0.05)

    def close(self) -> None:
        super().close()
        self.router.close()


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=32 * BLOCK_BYTES, disk_bytes=96 * BLOCK_BYTES)
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def make_engine(daemon: Daemon, model_dir, monkeypatch):
    yield from harness.closing_each(
        lambda **kwargs: EventEngine(daemon, model_dir, monkeypatch, **kwargs)
    )


def ours(router: Router, medium: str, hashes: list[int]) -> set[int]:
    return router.held[medium] & set(hashes)


def kvtier_events(router: Router) -> list:
    return [e for e in router.events if e.medium in (MEDIUM_CPU, MEDIUM_STORAGE)]


def announced(router: Router) -> set[int]:
    """Every hash kvtier's tiers ever named in the stream, stored or removed."""
    return {h for e in kvtier_events(router) for h in e.block_hashes}


def test_tiers_are_announced_stored_pushed_down_and_removed(make_engine, daemon) -> None:
    engine = make_engine(num_blocks=128)
    tokens = prompt(1, 4 * BLOCK)
    engine.add([*tokens, 1], "a")
    engine.run()
    want = router_hashes(tokens, 4, BLOCK)
    engine.until(lambda r: ours(r, MEDIUM_CPU, want) == set(want), "the host tier's blocks")
    engine.until(lambda r: ours(r, MEDIUM_STORAGE, want) == set(want), "the disk tier's blocks")
    stored = [e for e in kvtier_events(engine.router) if isinstance(e, BlockStored)]
    by_hash = {e.block_hashes[0]: e for e in stored if e.medium == MEDIUM_CPU}
    for i, h in enumerate(want):
        event = by_hash[h]
        assert event.token_ids == tokens[i * BLOCK : (i + 1) * BLOCK]
        assert event.block_size == BLOCK
        assert event.parent_block_hash == (want[i - 1] if i else None)
        assert event.group_idx == 0
        assert event.lora_name is None
    # Unrelated blocks (no vLLM identity: never announced) push ours out of both tiers.
    flood(engine, daemon, 160)
    engine.until(lambda r: not ours(r, MEDIUM_CPU, want), "the host tier's removals")
    engine.until(lambda r: not ours(r, MEDIUM_STORAGE, want), "the disk tier's removals")
    removed = [e for e in kvtier_events(engine.router) if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {MEDIUM_CPU, MEDIUM_STORAGE}
    assert all(h in want for e in removed for h in e.block_hashes)


def test_another_engine_announces_and_loads_what_one_stored(make_engine, daemon) -> None:
    first = make_engine(num_blocks=128)
    tokens = prompt(2, 4 * BLOCK)
    first.add([*tokens, 1], "a")
    first.run()
    want = set(router_hashes(tokens, 4, BLOCK))
    first.until(lambda r: ours(r, MEDIUM_STORAGE, want) == want, "the first engine's blocks")
    # The second engine attaches later: its replay announces what the tiers already hold.
    second = make_engine(num_blocks=128)
    second.until(lambda r: ours(r, MEDIUM_CPU, want) == want, "the first engine's host blocks")
    second.until(lambda r: ours(r, MEDIUM_STORAGE, want) == want, "its disk blocks")
    second.add([*tokens, 2], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 4
    # A restarted daemon has an empty host tier and the same disk tier: the host blocks are
    # withdrawn and the disk tier announced again.
    daemon.kill()
    mark = len(second.router.events)
    daemon.start()

    def disk_announced_again(router: Router) -> bool:
        again = {
            h
            for e in router.events[mark:]
            if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
            for h in e.block_hashes
        }
        return want <= again and not ours(router, MEDIUM_CPU, want)

    second.until(disk_announced_again, "the disk tier announced after the restart")


def test_salted_blocks_appear_only_under_their_salt(make_engine) -> None:
    engine = make_engine(num_blocks=128)
    tokens = prompt(3, 3 * BLOCK)
    for salt in ("red", "blue"):
        engine.add([*tokens, 1], salt, cache_salt=salt)
    engine.run()
    red, blue = (set(router_hashes(tokens, 3, BLOCK, salt)) for salt in ("red", "blue"))
    engine.until(lambda r: ours(r, MEDIUM_CPU, red | blue) == red | blue, "both salts' host blocks")
    assert not red & blue
    unsalted = set(router_hashes(tokens, 3, BLOCK))
    assert not announced(engine.router) & unsalted
    assert announced(engine.router) <= red | blue


def test_only_blocks_this_engine_can_load_are_announced(make_engine) -> None:
    other = make_engine(num_blocks=128, model_id="another-model")
    theirs = prompt(4, 3 * BLOCK)
    other.add([*theirs, 1], "theirs")
    other.run()
    mine = make_engine(num_blocks=128)
    tokens = prompt(5, 3 * BLOCK)
    mine.add([*tokens, 1], "mine")
    mine.run()
    want = set(router_hashes(tokens, 3, BLOCK))
    # The replay came first (the other model's blocks were in the tiers), then our blocks.
    mine.until(lambda r: ours(r, MEDIUM_STORAGE, want) == want, "this model's blocks")
    assert announced(mine.router) == want
    other.until(lambda r: ours(r, MEDIUM_CPU, set(router_hashes(theirs, 3, BLOCK))), "its blocks")
    assert not announced(other.router) & want


def test_an_engine_with_events_off_computes_no_block_identities(
    make_engine, daemon, model_dir, monkeypatch
) -> None:
    """The identities only routers read cost the engine's thread per stored block: an engine
    that publishes no events computes none (and one that does still stores them)."""
    computed = []
    identities = scheduler_module.identities

    def counted(*args):
        metas = identities(*args)
        computed.extend(metas)
        return metas

    monkeypatch.setattr(scheduler_module, "identities", counted)
    quiet = Engine(daemon, model_dir, num_blocks=128)
    try:
        quiet.add([*prompt(5, 4 * BLOCK), 1], "quiet")
        quiet.run()
        assert quiet.stats["stored_blocks"] == 4
        assert not computed
    finally:
        quiet.close()
    loud = make_engine(num_blocks=128)
    loud.add([*prompt(6, 4 * BLOCK), 1], "loud")
    loud.run()
    assert loud.stats["stored_blocks"] == 4
    assert len(computed) == 4 and all(computed)


# ---- an engine too slow for the daemon's events ----
TAG = b"slowtag!"
HOST_SLOTS = 64
ON_DISK = 2048
NEW = 3200  # about three events a block: past the 8,192 the daemon queues for a watcher


def identity_of(block_hash: bytes) -> bytes:
    """A router-sized identity (large token ids, as a long block's are) for one block."""
    identity = events_module.BlockIdentity(
        tag=TAG,
        group=0,
        block_hashes=[block_hash * 2],
        parent=None,
        token_ids=list(range(60_000, 60_100)),
    )
    return events_module.encode_identity(identity)


def store_with_identities(client, hashes: list[bytes]) -> None:
    """Stores every block with its identity, half the host slots at a time, waiting for room
    while slots are pinned by their writes to disk."""
    for i in range(0, len(hashes), HOST_SLOTS // 2):
        pending = hashes[i : i + HOST_SLOTS // 2]

        def stored_the_rest() -> bool:
            nonlocal pending
            slots = client.reserve(pending, [identity_of(h) for h in pending])
            mine = [(h, s) for h, s in zip(pending, slots, strict=True) if s >= 0]
            for h, s in mine:
                client.slab[s].numpy()[:] = content(h)
            assert client.commit([s for _, s in mine])
            done = {h for h, _ in mine}
            pending = [h for h in pending if h not in done]
            return not pending

        wait_until(stored_the_rest, "room in the host tier", 120)


def test_an_engine_that_falls_behind_the_daemons_events_follows_again(monkeypatch) -> None:
    """vLLM takes no events for a while (the engine is busy): the buffer fills, the daemon's
    queue for this engine overflows during a disk tier's replay, and the daemon ends the
    stream. The engine must follow again with a replay, so that the router's view ends equal
    to what the tiers hold: the blocks whose events were lost included, those the disk tier
    dropped meanwhile too."""
    monkeypatch.setattr(
        events_module,
        "TUNABLES",
        dataclasses.replace(events_module.TUNABLES, max_buffered_events=256),
    )
    daemon = Daemon(
        host_bytes=HOST_SLOTS * RAW_BLOCK_BYTES,
        disk_bytes=(ON_DISK + NEW // 2) * RAW_BLOCK_BYTES,  # the new blocks push old ones out
        extra=["--no-disk-sync", "--flush-interval-s", "0.05"],
    ).start()
    try:
        writer = daemon.client(client_name="writer")
        old = [block_hash("on-disk", i) for i in range(ON_DISK)]
        store_with_identities(writer, old)
        wait_until(lambda: disk_blocks(daemon) == ON_DISK, "the disk writes", 120)
        # Without window growth on the follower's channel, the stream stalls as soon as the
        # follower stops reading (with it, gRPC would buffer the events in this process).
        options = (*client_module._CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0))
        with monkeypatch.context() as patch:
            patch.setattr(client_module, "_CHANNEL_OPTIONS", options)
            follower = daemon.client(client_name="follower")
        tier_events = events_module.TierEvents([follower], lambda: {TAG: 0}, BLOCK)
        try:
            new = [block_hash("new", i) for i in range(NEW)]
            store_with_identities(writer, new)
            wait_until(lambda: daemon.stats().events_dropped > 0, "events lost", 120)
            view = {MEDIUM_CPU: set(), MEDIUM_STORAGE: set()}

            def caught_up() -> bool:
                for event in tier_events.take():
                    held = view[event.medium]
                    if isinstance(event, BlockStored):
                        held.update(event.block_hashes)
                    else:
                        held.difference_update(event.block_hashes)
                return view == tiers_held(daemon)

            wait_until(caught_up, "the router's view to equal the tiers", 120)
            assert tier_events.lost >= 1
            assert disk_tier(daemon).blocks_evicted > 0
        finally:
            tier_events.close()
        writer.close()
        follower.close()
    finally:
        daemon.cleanup()


def disk_tier(daemon: Daemon):
    return next(t for t in daemon.stats().tiers if t.tier == "disk")


def disk_blocks(daemon: Daemon) -> int:
    return disk_tier(daemon).used_blocks


def tiers_held(daemon: Daemon) -> dict[str, set]:
    """What the tiers hold, in the router's terms, as a new watch's replay reads them."""
    held = {MEDIUM_CPU: set(), MEDIUM_STORAGE: set()}
    channel, stub = daemon.stub()
    with channel:
        request = pb.WatchRequest(layout_signature=SIGNATURE, replay=True)
        stream = stub.WatchEvents(request, timeout=120)
        for batch in stream:
            for event in batch.events:
                held[events_module.MEDIUMS[event.tier]].add(
                    maybe_convert_block_hash(event.hash * 2)
                )
            if batch.replay_done:
                break
        stream.cancel()
    return held
