"""The shared-memory lookup index: the daemon writes it, clients probe it without a call."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvtier.connector.client.index_reader import LookupIndexReader
from kvtier.proto.lookup_index import (
    DISK,
    HEADER,
    HEADER_BYTES,
    HOST,
    MAGIC,
    MIN_CAPACITY,
    RECORD_BYTES,
    LookupIndexWriter,
    _place,
    index_path,
    keep,
)

from daemonutil import BLOCK_BYTES, SIGNATURE, Daemon, block_hash, store, wait_until


def h(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def test_a_probe_reads_each_hashs_tiers_and_misses_what_no_tier_holds(tmp_path):
    writer = LookupIndexWriter(tmp_path / "idx", blocks=64)
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        writer.set(h(1), HOST)
        writer.set(h(2), DISK)
        writer.set(h(3), HOST)
        writer.set(h(3), DISK)
        assert reader.probe([h(1), h(2), h(3), h(4)]).tolist() == [HOST, DISK, HOST | DISK, 0]
        writer.clear(h(3), HOST)
        writer.clear(h(1), HOST)
        writer.clear(h(9), DISK)  # never held: nothing to clear
        assert reader.probe([h(1), h(2), h(3), h(9)]).tolist() == [0, DISK, DISK, 0]
        assert stat.S_IMODE(os.stat(tmp_path / "idx").st_mode) == 0o600
    finally:
        writer.close()
    assert reader.probe([h(2)]) is None  # retired and unlinked: ask the daemon instead
    assert not (tmp_path / "idx").exists()


def test_a_full_table_is_rebuilt_and_readers_follow_it(tmp_path):
    """Far more hashes than the first table holds, most of them cleared again: the writer
    rebuilds, the old file is retired and a reader that mapped it moves to the new one."""
    writer = LookupIndexWriter(tmp_path / "idx", blocks=1)
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        assert reader.probe([h(0)]).tolist() == [0]
        live = set()
        for i in range(5 * MIN_CAPACITY):
            writer.set(h(i), HOST)
            live.add(i)
            if i % 3:
                writer.clear(h(i), HOST)
                live.discard(i)
        got = reader.probe([h(i) for i in range(5 * MIN_CAPACITY)])
        assert [i for i, bits in enumerate(got) if bits] == sorted(live)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
    finally:
        writer.close()


def test_a_batch_that_outgrows_the_table_lands_whole_in_the_rebuilt_one(tmp_path):
    """``set_all`` (a commit's batch) rebuilds the table in the middle of its batch and goes
    on in the new one; ``clear_all`` (an eviction's) clears in either."""
    writer = LookupIndexWriter(tmp_path / "idx", blocks=1)
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        batch = [h(i) for i in range(3 * MIN_CAPACITY)]
        writer.set_all(batch, HOST)
        writer.set_all(batch[::2], DISK)
        writer.clear_all([*batch[: MIN_CAPACITY // 2], h(1 << 40)], HOST)
        got = reader.probe([*batch, h(1 << 40)]).tolist()
        want = [
            (HOST if i >= MIN_CAPACITY // 2 else 0) | (DISK if i % 2 == 0 else 0)
            for i in range(len(batch))
        ]
        assert got == [*want, 0]
    finally:
        writer.close()


def test_a_probe_of_a_torn_or_foreign_file_never_claims_a_hit(tmp_path):
    path = tmp_path / "idx"
    path.write_bytes(os.urandom(4096))
    assert LookupIndexReader(path).probe([h(1)]) is None
    assert LookupIndexReader(tmp_path / "missing").probe([h(1)]) is None


def test_the_index_lives_beside_the_daemons_socket():
    path = index_path("/run/user/1/kvtier/default.sock", bytes(range(16)))
    assert str(path) == f"/run/user/1/kvtier/default.sock.{bytes(range(16)).hex()}.index"


def test_a_batch_probe_equals_probes_one_by_one(tmp_path):
    writer = LookupIndexWriter(tmp_path / "idx", blocks=4096)
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        rng = np.random.default_rng(0)
        for i in rng.choice(8192, 3000, replace=False):
            writer.set(h(int(i)), HOST if i % 2 else DISK)
        hashes = [h(i) for i in range(8192)]
        batch = reader.probe(hashes).tolist()
        assert batch == [int(reader.probe([x])[0]) for x in hashes]
        assert sum(1 for b in batch if b) == 3000
    finally:
        writer.close()


def test_a_prefix_probe_stops_at_the_first_miss_and_counts_its_host_hits(tmp_path):
    """What a lookup asks: how many hashes from the first some tier holds, and how many of
    those the host does; the walk stops at the first miss (the rest are no prefix hits)."""
    writer = LookupIndexWriter(tmp_path / "idx", blocks=4096)
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        rng = np.random.default_rng(1)
        tiers = rng.choice([0, HOST, DISK, HOST | DISK], 2000, p=[0.02, 0.4, 0.3, 0.28])
        for i, bits in enumerate(tiers.tolist()):
            for tier in (HOST, DISK):
                if bits & tier:
                    writer.set(h(i), tier)
        hashes = [h(i) for i in range(len(tiers))]
        for start in range(0, len(hashes), 97):
            asked = hashes[start : start + 300]
            expected = tiers[start : start + 300]
            misses = np.flatnonzero(expected == 0)
            held = int(misses[0]) if len(misses) else len(asked)
            bits = np.zeros(len(asked), np.uint8)
            found = reader.probe_prefix(b"".join(asked), bits)
            assert found.held == held
            assert found.host == int(np.count_nonzero(expected[:held] & HOST))
            assert bits[:held].tolist() == expected[:held].tolist()
            assert not bits[held:].any()
            assert reader.probe_prefix(b"".join(asked)) == found  # the counts without bits
        assert reader.probe_prefix(b"".join([h(10**6), *hashes[:5]])).held == 0
        with pytest.raises(ValueError):
            reader.probe_prefix(b"".join(hashes[:4]), np.zeros(3, np.uint8))
    finally:
        writer.close()


def test_a_file_with_a_capacity_no_writer_gives_answers_no_probe(tmp_path):
    """A file with the index's magic but a capacity the writer never makes (not a power of
    two) or one larger than the file, kept by a live lock: no probe is answered from it (the
    compiled probe checks no bounds; the reader's checks keep it inside the map)."""
    for capacity, records in ((3 * MIN_CAPACITY, 3 * MIN_CAPACITY), (1 << 30, MIN_CAPACITY)):
        path = tmp_path / f"idx-{capacity}"
        header = HEADER.pack(MAGIC, capacity, 1, 0, 0).ljust(HEADER_BYTES, b"\0")
        path.write_bytes(header + bytes(records * RECORD_BYTES))
        fd = os.open(path, os.O_RDWR)
        try:
            keep(fd)  # as a live writer holds it
            assert LookupIndexReader(path).probe([h(1)]) is None
        finally:
            os.close(fd)


def test_a_client_that_can_cache_no_compiled_probe_still_probes(tmp_path):
    """Where numba finds no writable place for its cache (a read-only install, no writable
    home), the probe is compiled in the process instead of failing the engine's import."""
    code = f"""
from numba.core import caching
caching.CacheImpl._locator_classes = []  # no cache location anywhere
from kvtier.connector.client.index_reader import LookupIndexReader, load_probe
assert load_probe()
from kvtier.proto.lookup_index import HOST, LookupIndexWriter
writer = LookupIndexWriter({str(tmp_path / "idx")!r}, blocks=8)
writer.set(bytes(range(16)), HOST)
found = LookupIndexReader({str(tmp_path / "idx")!r}).probe_prefix(bytes(range(16)))
assert (found.held, found.host) == (1, 1), found
writer.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_daemon_publishes_its_host_and_disk_tiers_and_a_restart_finds_the_disk_again():
    """A real daemon: commits appear as host bits, evictions leave the disk bit; a restarted
    daemon publishes the disk tier it reopened; a stopped one retires its index."""
    daemon = Daemon(host_bytes=8 * BLOCK_BYTES, disk_bytes=256 * BLOCK_BYTES).start()
    try:
        client = daemon.client()
        first = [block_hash("indexed", i) for i in range(4)]
        assert store(client, first) == first
        path = index_path(daemon.socket, SIGNATURE)
        reader = LookupIndexReader(path)
        wait_until(lambda: reader.probe(first).tolist() == [HOST | DISK] * 4, "written down")
        flood = [block_hash("flood", i) for i in range(16)]
        for i in range(0, 16, 4):
            store(client, flood[i : i + 4])
            client.settle(10)
        wait_until(lambda: reader.probe(first).tolist() == [DISK] * 4, "evicted from host")
        client.close()
        assert daemon.stop() == 0, daemon.log.read_text()
        assert reader.probe(first) is None  # retired with its daemon
        daemon.start()
        client = daemon.client()
        reader = LookupIndexReader(index_path(daemon.socket, SIGNATURE))
        assert reader.probe([*first, block_hash("never", 0)]).tolist() == [DISK] * 4 + [0]
        client.close()
    finally:
        daemon.stop()
        daemon.cleanup()


def test_hashes_alike_in_their_first_bytes_still_spread(tmp_path):
    """Hashes that share their first 8 bytes (not xxh3 output) must not pile into one
    cluster longer than a probe walks: every one of them is found."""
    writer = LookupIndexWriter(tmp_path / "idx", blocks=512)
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        alike = [bytes(8) + i.to_bytes(8, "little") for i in range(1, 513)]
        for x in alike:
            writer.set(x, HOST)
        assert reader.probe(alike).tolist() == [HOST] * len(alike)
    finally:
        writer.close()


def test_a_lookup_the_index_answers_still_reaches_the_daemon():
    """The probe answers at once; the call that follows unwaited is what the daemon counts
    (a miss too), and it holds the host hits for the acquire as a waited-for call would."""
    daemon = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    try:
        client = daemon.client(lookup_index=True)
        tokens = client.block_tokens
        held = [block_hash("probed", i) for i in range(4)]
        assert store(client, held) == held
        reader = LookupIndexReader(index_path(daemon.socket, SIGNATURE))
        wait_until(lambda: reader.probe(held).all(), "the commit to be published")

        def host_tokens() -> tuple[int, int]:
            tier = next(t for t in daemon.stats().tiers if t.tier == "host")
            return tier.query_tokens, tier.hit_tokens

        asked, hit = host_tokens()
        never = [block_hash("never-stored", i) for i in range(3)]
        assert client.lookup(never).total == 0
        assert client.lookup([*held, never[0]]).host == len(held)
        assert client._lookups.probed == 2
        want = (asked + (3 + 5) * tokens, hit + 4 * tokens)
        wait_until(lambda: host_tokens() == want, "the daemon to count both lookups")
        wait_until(lambda: daemon.stats().layouts[0].held_slots == len(held), "the hold")
        client.close()
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_rebuild_places_colliding_hashes_where_a_probe_walks_to_them():
    """``_place`` puts a whole batch at once: hashes sharing a home (and runs of homes that
    wrap past the table's end) each land on a distinct record with every record between its
    home and it taken, so a reader's linear probe reaches it before an empty record."""
    capacity = 64
    homes = np.array([5] * 6 + [6, 7, 63, 63, 63, 0, 62, 30], np.int64)
    placed = _place(homes, capacity)
    assert len(set(placed.tolist())) == len(homes)
    taken = set(placed.tolist())
    for home, record in zip(homes.tolist(), placed.tolist(), strict=True):
        walk = home
        while walk != record:
            assert walk in taken, (home, record)
            walk = (walk + 1) % capacity
    # the first of a home takes it; the others wait for what 6 and 7 took in the same round
    assert placed[homes == 5].tolist() == [5, 8, 9, 10, 11, 12]
    assert placed[-1] == 30
