"""Two daemons ("nodes", each with its own host and disk tiers) sharing one real Redis store.

A prefix stored through node A is loaded bit-exact through node B, which never saw it: B's
Lookup finds it in the remote tier, its Acquire promotes it into B's host slots (and B's disk
tier), and B's statistics count it as a remote hit. A value corrupted in the store is a miss,
and a store that is down costs misses while both nodes' own tiers keep serving.
"""

from __future__ import annotations

import pytest

from kvtier.bench.redis_server import RedisProcess

from daemonutil import BLOCK_BYTES, Daemon, block_hash, load, store
from redisutil import wait_until


@pytest.fixture
def nodes():
    with RedisProcess() as server:
        extra = ["--remote", server.url, "--flush-interval-s", "0.05"]
        a = Daemon(host_bytes=64 * BLOCK_BYTES, extra=extra).start()
        b = Daemon(host_bytes=64 * BLOCK_BYTES, extra=extra).start()
        try:
            yield server, a, b
        finally:
            a.cleanup()
            b.cleanup()


def remote_tier(daemon: Daemon):
    return next(t for t in daemon.stats().tiers if t.tier == "remote")


def test_a_prefix_stored_on_one_node_is_a_remote_hit_on_another(nodes):
    server, a, b = nodes
    hashes = [block_hash("shared-prefix", i) for i in range(12)]
    on_a = a.client(client_name="engine-a")
    assert store(on_a, hashes) == hashes
    wait_until(lambda: remote_tier(a).blocks_stored == len(hashes), "node A's remote writes")
    on_b = b.client(client_name="engine-b")
    hits = on_b.lookup(hashes)
    assert (hits.host, hits.disk, hits.remote) == (0, 0, len(hashes))
    slots, sources = on_b.acquire_with_sources(hashes)
    assert sources.remote == len(hashes)
    on_b.release(slots)
    assert load(on_b, hashes) == hashes  # now host hits on B, checked byte for byte
    assert on_b.lookup(hashes).host == len(hashes)
    remote_b = remote_tier(b)
    assert remote_b.hit_tokens == len(hashes) * 16
    host_b = next(t for t in b.stats().tiers if t.tier == "host")
    assert host_b.blocks_promoted == len(hashes)
    # B's disk tier got them too: B keeps them even with the store gone
    wait_until(
        lambda: next(t for t in b.stats().tiers if t.tier == "disk").used_blocks == len(hashes),
        "node B's disk writes",
    )
    server.kill()
    assert load(on_b, hashes) == hashes
    assert on_b.failures == 0
    on_a.close()
    on_b.close()


def test_a_corrupted_value_is_a_miss_and_a_dead_store_costs_misses_only(nodes):
    server, a, b = nodes
    hashes = [block_hash("corrupt", i) for i in range(4)]
    on_a = a.client(client_name="engine-a")
    assert store(on_a, hashes) == hashes
    wait_until(lambda: remote_tier(a).blocks_stored == len(hashes), "node A's remote writes")
    redis = server.client()
    key = next(k for k in redis.scan_iter("kvtier:*") if k.endswith(hashes[2].hex().encode()))
    value = bytearray(redis.get(key))
    value[-1] ^= 0xFF
    redis.set(key, bytes(value))
    on_b = b.client(client_name="engine-b")
    assert on_b.lookup(hashes).remote == len(hashes)  # the key is still there
    assert load(on_b, hashes) == hashes[:2]  # the third fails its checksum: a miss
    assert remote_tier(b).checksum_failures == 1
    server.kill()
    others = [block_hash("own", i) for i in range(4)]
    assert store(on_b, others) == others
    assert load(on_b, others) == others  # the node's own tiers keep working
    assert on_b.lookup([block_hash("nowhere", 0)]).total == 0
    on_a.close()
    on_b.close()
