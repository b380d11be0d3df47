"""The remote tier on a real 3-node Redis cluster: blocks spread over every node, and a node
killed costs only its own keys."""

from __future__ import annotations

import threading

import pytest

from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.format import block_key, check_prefix, key_prefix
from kvtier.tiers.remote.redis import RedisClusterBackend, RedisOptions
from kvtier.tiers.remote.tier import RemoteSettings, RemoteTier

from redisutil import (
    BLOCK_BYTES,
    FAST,
    SIGNATURE,
    WAIT_S,
    LocalCluster,
    assert_exact,
    block_hash,
    fetch,
    store,
    wait_until,
)

PREFIX = key_prefix(SIGNATURE)


@pytest.fixture
def cluster():
    with LocalCluster() as c:
        yield c


def open_tier(cluster: LocalCluster) -> RemoteTier:
    config = RemoteConfig(cluster.url, settings=FAST)
    return config.open_tier(SIGNATURE, BLOCK_BYTES)


def key(h: bytes) -> bytes:
    return block_key(check_prefix(PREFIX), h)


def test_blocks_spread_over_every_node_and_come_back_exact(cluster):
    tier = open_tier(cluster)
    hashes = [block_hash("spread", i) for i in range(48)]
    try:
        assert store(tier, hashes, meta=lambda h: h[:4]) == [True] * 48
        assert tier.lookup_prefix(hashes) == 48
        metas, outs = fetch(tier, hashes)
        assert metas == [h[:4] for h in hashes]
        assert_exact(hashes, outs)
        held = [node.client().dbsize() for node in cluster.nodes]
        assert sum(held) == 48 and all(held), held
        assert store(tier, hashes) == [True] * 48
        assert tier.counters.blocks_deduplicated == 48
    finally:
        tier.close()


def test_a_killed_node_costs_only_its_own_keys_and_rejoins(cluster):
    tier = open_tier(cluster)
    hashes = [block_hash("node", i) for i in range(30)]
    try:
        store(tier, hashes)
        owner = {h: cluster.node_of(key(h)) for h in hashes}
        victim = cluster.nodes[1]
        lost = [h for h in hashes if owner[h] is victim]
        kept = [h for h in hashes if owner[h] is not victim]
        assert lost and kept
        victim.kill()
        for h in kept:
            metas, outs = fetch(tier, [h])
            assert len(metas) == 1
            assert_exact([h], outs)
        for h in lost:
            assert fetch(tier, [h])[0] == []
        first_lost = hashes.index(lost[0])
        assert tier.lookup_prefix(hashes) == first_lost
        assert tier.counters.fault_misses >= len(lost)
        wait_until(lambda: tier.lookup_prefix(lost) == 0 and tier.open_routes(), "breaker")
        assert tier.open_routes() == [victim.address]
        assert all(len(fetch(tier, [h])[0]) == 1 for h in kept)  # the others still answer

        victim.start()  # rejoins with its node id, empty
        wait_until(cluster.healthy, "the cluster to be whole again")
        wait_until(lambda: not tier.open_routes(), "the probe to close the breaker")
        assert tier.lookup_prefix(lost) == 0
        assert store(tier, lost) == [True] * len(lost)
        metas, outs = fetch(tier, hashes)
        assert len(metas) == 30
        assert_exact(hashes, outs)
    finally:
        tier.close()


class SpyCluster(RedisClusterBackend):
    """The real cluster backend, telling when a get has begun on each node."""

    def __init__(self, seeds, options):
        super().__init__(seeds, options)
        self.gets = {}

    def get(self, route, keys):
        self.gets.setdefault(route, threading.Event()).set()
        return super().get(route, keys)


def test_a_frozen_node_holds_up_only_its_own_keys(cluster):
    # Nothing gives up on the frozen node before the test thaws it: what the other nodes
    # answer meanwhile, they answer while a call to it is still stuck.
    patient = RemoteSettings(lookup_timeout_s=WAIT_S, transfer_timeout_s=WAIT_S, connections=2)
    backend = SpyCluster(
        [("127.0.0.1", n.port) for n in cluster.nodes], RedisOptions(socket_timeout_s=WAIT_S)
    )
    tier = RemoteTier(backend, SIGNATURE, BLOCK_BYTES, PREFIX, patient)
    hashes = [block_hash("frozen-node", i) for i in range(24)]
    try:
        store(tier, hashes)
        victim = cluster.nodes[2]
        lost = [h for h in hashes if cluster.node_of(key(h)) is victim]
        kept = [h for h in hashes if cluster.node_of(key(h)) is not victim]
        victim.pause()
        stuck = {}
        reader = threading.Thread(target=lambda: stuck.update(result=fetch(tier, lost[:1])))
        reader.start()
        try:
            wait_until(lambda: victim.address in backend.gets, "the get to reach the frozen node")
            for h in kept:
                metas, outs = fetch(tier, [h])
                assert len(metas) == 1
                assert_exact([h], outs)
            assert tier.lookup_prefix(kept[:3]) == 3
            assert reader.is_alive()
        finally:
            victim.resume()
        reader.join(WAIT_S)
        assert len(stuck["result"][0]) == 1
    finally:
        tier.close()


def test_a_cluster_down_at_start_is_found_once_it_is_up():
    cluster = LocalCluster()  # its ports are chosen, its servers not started
    backend = RedisClusterBackend([("127.0.0.1", n.port) for n in cluster.nodes])
    tier = RemoteTier(backend, SIGNATURE, BLOCK_BYTES, PREFIX, FAST)
    hashes = [block_hash("down", i) for i in range(6)]
    try:
        assert tier.lookup_prefix(hashes) == 0 and fetch(tier, hashes)[0] == []
        assert tier.counters.fault_misses > 0
        with cluster:
            wait_until(lambda: store(tier, hashes) == [True] * 6, "writes to reach the cluster")
            assert tier.lookup_prefix(hashes) == 6
            metas, outs = fetch(tier, hashes)
            assert len(metas) == 6
            assert_exact(hashes, outs)
    finally:
        tier.close()
        cluster.close()
