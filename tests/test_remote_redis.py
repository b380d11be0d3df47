"""The remote tier on one real redis-server: exact blocks, dedup, corrupt values, the queue."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.bench.redis_server import RedisProcess
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.remote.format import block_key, check_prefix, key_prefix
from kvtier.tiers.remote.redis import _PACKER, Parts, RedisStandalone
from kvtier.tiers.remote.tier import RemoteSettings, RemoteTier

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

PREFIX = key_prefix(SIGNATURE)


@pytest.fixture(scope="module")
def server():
    with RedisProcess(maxmemory=512 << 20) as srv:
        yield srv


@pytest.fixture
def tier(server):
    server.client().flushall()
    t = RemoteTier(RedisStandalone("127.0.0.1", server.port), SIGNATURE, BLOCK_BYTES, PREFIX, FAST)
    yield t
    t.close()


def key(h: bytes) -> bytes:
    return block_key(check_prefix(PREFIX), h)


def set_calls(server: RedisProcess) -> int:
    stats = server.client().info("commandstats")
    return stats.get("cmdstat_set", {}).get("calls", 0)


def test_blocks_come_back_bit_exact_with_their_meta(tier):
    hashes = [block_hash("exact", i) for i in range(20)]
    assert store(tier, hashes, meta=lambda h: b"engine:" + h) == [True] * 20
    assert tier.lookup_prefix(hashes) == 20
    metas, outs = fetch(tier, hashes)
    assert metas == [b"engine:" + h for h in hashes]
    assert_exact(hashes, outs)
    c = tier.counters
    assert (c.blocks_stored, c.blocks_loaded, c.bytes_out) == (20, 20, 20 * BLOCK_BYTES)
    assert c.fault_misses == c.checksum_failures == c.blocks_dropped == 0


def test_prefix_stops_at_the_first_block_the_store_lacks(tier):
    hashes = [block_hash("prefix", i) for i in range(10)]
    store(tier, hashes[:4] + hashes[5:])
    assert tier.lookup_prefix(hashes) == 4
    metas, outs = fetch(tier, hashes)
    assert len(metas) == 4
    assert_exact(hashes, outs)
    assert tier.lookup_prefix([]) == 0 and tier.get_into([], []) == []


def test_a_block_the_store_holds_is_not_written_again(tier, server):
    hashes = [block_hash("dedup", i) for i in range(12)]
    store(tier, hashes)
    sets = set_calls(server)
    assert store(tier, hashes) == [True] * 12
    assert set_calls(server) == sets
    assert tier.counters.blocks_deduplicated == 12 and tier.counters.blocks_stored == 12


def test_a_block_already_queued_is_not_queued_twice(tier, server):
    h = block_hash("twice", 0)
    first, second = [], []
    server.pause()  # the first write stays in flight
    try:
        tier.write_behind(h, content(h), b"", first.append)
        tier.write_behind(h, content(h), b"", second.append)
        assert second == [True] and tier.counters.blocks_deduplicated == 1
    finally:
        server.resume()
    tier.flush(WAIT_S)
    assert len(first) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_value_is_a_counted_miss_and_is_deleted(tier, server, damage):
    hashes = [block_hash("damage", i) for i in range(3)]
    store(tier, hashes)
    raw = server.client()
    victim = key(hashes[1])
    value = raw.get(victim)
    if damage == "flip":
        raw.setrange(victim, len(value) - 100, bytes([value[-100] ^ 0xFF]))
    elif damage == "truncate":
        raw.set(victim, value[: len(value) // 2])
    else:
        raw.set(victim, raw.get(key(hashes[2])))
    metas, outs = fetch(tier, hashes)
    assert len(metas) == 1
    assert_exact(hashes, outs)
    assert tier.counters.checksum_failures == 1
    wait_until(lambda: not raw.exists(victim), "the corrupt value to be deleted")
    assert store(tier, [hashes[1]]) == [True]
    assert len(fetch(tier, hashes)[0]) == 3


def test_a_value_of_another_layout_is_a_miss(tier, server):
    other = RemoteTier(
        RedisStandalone("127.0.0.1", server.port), bytes(16), BLOCK_BYTES, PREFIX, FAST
    )
    try:
        h = block_hash("layout", 0)
        store(other, [h])
        assert tier.lookup_prefix([h]) == 1  # same key: a prefix must carry the layout
        assert fetch(tier, [h])[0] == []
        assert tier.counters.checksum_failures == 1
    finally:
        other.close()


def test_a_full_queue_drops_at_once_and_counts(server):
    server.client().flushall()
    settings = RemoteSettings(queue_bytes=2 * BLOCK_BYTES, batch_blocks=4, transfer_timeout_s=30)
    tier = RemoteTier(
        RedisStandalone("127.0.0.1", server.port), SIGNATURE, BLOCK_BYTES, PREFIX, settings
    )
    hashes = [block_hash("queue", i) for i in range(20)]
    calls: dict[bytes, list[bool]] = {h: [] for h in hashes}
    dropped_at_once = 0
    server.pause()
    try:
        for h in hashes:
            tier.write_behind(h, content(h), b"", calls[h].append)
            dropped_at_once += calls[h] == [False]
    finally:
        server.resume()
    tier.flush(WAIT_S)
    tier.close()
    # At most one batch in flight and two queued: the other 14 never waited.
    assert dropped_at_once >= 14
    assert all(len(c) == 1 for c in calls.values())
    stored = [h for h in hashes if calls[h] == [True]]
    assert stored and tier.counters.blocks_stored == len(stored)
    assert tier.counters.blocks_dropped == len(hashes) - len(stored)
    raw = server.client()
    assert all(raw.exists(key(h)) for h in stored)


def test_writes_borrow_the_callers_buffer_until_done(tier):
    h = block_hash("borrow", 0)
    data = content(h).copy()
    done = threading.Event()
    tier.write_behind(h, data, b"", lambda ok: done.set())
    assert done.wait(WAIT_S)
    data[:] = 0  # the caller may reuse its buffer now; the store kept the block
    _, outs = fetch(tier, [h])
    assert_exact([h], outs)


def test_close_answers_every_queued_write_once_and_refuses_new_ones(server):
    server.client().flushall()
    tier = RemoteTier(RedisStandalone("127.0.0.1", server.port), SIGNATURE, BLOCK_BYTES, PREFIX)
    hashes = [block_hash("close", i) for i in range(40)]
    calls = {h: [] for h in hashes}
    for h in hashes:
        tier.write_behind(h, content(h), b"", calls[h].append)
    tier.close()
    assert all(len(c) == 1 for c in calls.values())
    late = []
    tier.write_behind(hashes[0], content(hashes[0]), b"", late.append)
    assert late == [False] and tier.counters.blocks_dropped >= 1
    tier.close()  # idempotent


def test_bad_arguments_raise(tier):
    h = block_hash("bad", 0)
    with pytest.raises(ValueError):
        tier.write_behind(h, np.zeros(BLOCK_BYTES - 1, np.uint8))
    with pytest.raises(ValueError):
        tier.write_behind(h, content(h), b"x" * 5000)
    with pytest.raises(ValueError):
        tier.write_behind(b"short", content(h))
    with pytest.raises(ValueError):
        tier.get_into([h], [np.zeros(BLOCK_BYTES, np.uint8).tobytes()])  # read-only
    with pytest.raises(ValueError):
        tier.get_into([h, h], [np.zeros(BLOCK_BYTES, np.uint8)])


def test_a_value_in_parts_goes_out_as_one_bulk_string_uncopied():
    payload = memoryview(bytearray(b"payload" * 1000))
    packed = _PACKER.pack("SET", b"key", Parts((b"head", payload)))
    assert any(
        chunk is payload or (isinstance(chunk, memoryview) and chunk.obj is payload.obj)
        for chunk in packed
    )
    whole = b"head" + bytes(payload)
    plain = b"".join(bytes(c) for c in _PACKER.pack("SET", b"key", whole))
    assert b"".join(bytes(c) for c in packed) == plain


def test_remote_promotions_take_no_buffer_per_block(tier, tmp_path, monkeypatch):
    """Remote hits promoted into host slots reach the disk tier from those slots: the
    promotion takes no copy buffer of its own per block, so the buffers alive at once stay
    bounded however many blocks are promoted."""
    hashes = [block_hash("promoted", i) for i in range(48)]
    assert store(tier, hashes) == [True] * len(hashes)
    disk = DiskTier(tmp_path, SIGNATURE, BLOCK_BYTES, 1024 * BLOCK_BYTES)
    try:
        host = HostTier(BLOCK_BYTES, 64 * BLOCK_BYTES, lower=disk, remote=tier, write_behind=True)
        pool = disk._s.pool
        taken, given = pool.acquire, pool.release
        caller = threading.get_ident()
        counts = {"by_caller": 0, "alive": 0, "most_alive": 0}
        lock = threading.Lock()

        def counted_acquire():
            with lock:
                counts["by_caller"] += threading.get_ident() == caller
                counts["alive"] += 1
                counts["most_alive"] = max(counts["most_alive"], counts["alive"])
            return taken()

        def counted_release(buf):
            with lock:
                counts["alive"] -= 1
            given(buf)

        monkeypatch.setattr(pool, "acquire", counted_acquire)
        monkeypatch.setattr(pool, "release", counted_release)
        slots, sources = host.acquire_with_sources(hashes)
        assert sources.remote == len(hashes)
        assert_exact(hashes, [host.slot_array(s) for s in slots])
        host.release(slots)
        disk.flush(WAIT_S)
        assert counts["by_caller"] == 0, f"{counts['by_caller']} buffers taken by promotions"
        assert counts["most_alive"] <= 8, counts  # the disk writer's bounces, if any
        wait_until(lambda: host.writing_behind == 0, "the promoted blocks' disk writes")
        assert disk.holding(hashes) == set(hashes)
        evicting = [block_hash("evicting", i) for i in range(64)]
        assert min(host.reserve(evicting)) >= 0  # every promoted slot was unpinned again
    finally:
        disk.close()
