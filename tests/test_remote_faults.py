"""The remote tier when its store is killed, frozen or not there yet: counted misses, a circuit
breaker that stops calling it, and recovery when it is back. Real redis-server processes."""

from __future__ import annotations

import threading

import pytest

from kvtier.bench.redis_server import RedisProcess, free_port
from kvtier.tiers.remote.format import key_prefix
from kvtier.tiers.remote.redis import RedisStandalone
from kvtier.tiers.remote.tier import RemoteTier

from redisutil import (
    BLOCK_BYTES,
    FAST,
    SIGNATURE,
    WAIT_S,
    assert_exact,
    block_hash,
    content,
    fetch,
    store,
    wait_until,
)


class SpyStandalone(RedisStandalone):
    """The real backend, counting the calls that reach it and telling when a get has begun."""

    def __init__(self, port: int) -> None:
        super().__init__("127.0.0.1", port)
        self.calls = 0
        self.get_started = threading.Event()

    def exists(self, route, keys):
        self.calls += 1
        return super().exists(route, keys)

    def get(self, route, keys):
        self.calls += 1
        self.get_started.set()
        return super().get(route, keys)


@pytest.fixture
def server():
    srv = RedisProcess().start()
    yield srv
    srv.close()


def open_tier(port: int) -> tuple[RemoteTier, SpyStandalone]:
    backend = SpyStandalone(port)
    return RemoteTier(backend, SIGNATURE, BLOCK_BYTES, key_prefix(SIGNATURE), FAST), backend


def test_store_killed_mid_get_gives_misses_cuts_it_off_and_recovers(server):
    tier, backend = open_tier(server.port)
    hashes = [block_hash("killed", i) for i in range(16)]
    try:
        assert store(tier, hashes) == [True] * 16
        fetched = {}
        server.pause()  # the get is sent and waits for an answer that will never come
        reader = threading.Thread(target=lambda: fetched.update(result=fetch(tier, hashes)))
        reader.start()
        assert backend.get_started.wait(WAIT_S)
        server.kill()
        reader.join(WAIT_S)
        metas, _ = fetched["result"]
        assert metas == []
        assert tier.counters.fault_misses >= 1 and tier.counters.blocks_loaded == 0

        wait_until(lambda: tier.lookup_prefix(hashes) == 0 and tier.open_routes(), "breaker")
        calls = backend.calls
        assert tier.lookup_prefix(hashes) == 0 and fetch(tier, hashes)[0] == []
        dropped = []
        tier.write_behind(hashes[0], content(hashes[0]), b"", dropped.append)
        assert dropped == [False]
        assert backend.calls == calls  # cut off: nothing reached the dead store
        assert tier.counters.breaker_trips == 1

        server.start()  # back on the same port, empty
        wait_until(lambda: not tier.open_routes(), "the probe to close the breaker")
        assert tier.lookup_prefix(hashes) == 0
        assert store(tier, hashes) == [True] * 16
        metas, outs = fetch(tier, hashes)
        assert len(metas) == 16
        assert_exact(hashes, outs)
    finally:
        tier.close()


def test_a_frozen_store_times_out_into_misses_and_its_blocks_return_with_it(server):
    tier, _ = open_tier(server.port)
    hashes = [block_hash("frozen", i) for i in range(8)]
    try:
        store(tier, hashes)
        server.pause()
        try:
            assert tier.lookup_prefix(hashes) == 0
            assert tier.counters.fault_misses == 8
            wait_until(lambda: tier.lookup_prefix(hashes) == 0 and tier.open_routes(), "breaker")
        finally:
            server.resume()
        wait_until(lambda: not tier.open_routes(), "the probe to close the breaker")
        assert tier.lookup_prefix(hashes) == 8
        metas, outs = fetch(tier, hashes)
        assert len(metas) == 8
        assert_exact(hashes, outs)
    finally:
        tier.close()


def test_a_node_starts_while_its_store_is_down_and_uses_it_once_up():
    port = free_port()
    tier, _ = open_tier(port)
    hashes = [block_hash("late", i) for i in range(4)]
    try:
        assert tier.lookup_prefix(hashes) == 0
        assert fetch(tier, hashes)[0] == []
        assert tier.counters.fault_misses > 0
        with RedisProcess(port) as late:
            wait_until(lambda: store(tier, hashes) == [True] * 4, "writes to reach the store")
            assert tier.lookup_prefix(hashes) == 4
            assert late.client().dbsize() == 4
    finally:
        tier.close()
