"""The remote tier on a real Mooncake Store over TCP: its master (with the HTTP metadata server)
and a storage process lending it memory, both from the wheel's own binaries."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvtier.bench.redis_server import free_port
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.format import block_key, check_prefix, key_prefix

from redisutil import (
    BLOCK_BYTES,
    FAST,
    SIGNATURE,
    assert_exact,
    block_hash,
    fetch,
    store,
    wait_until,
)

mooncake = pytest.importorskip("mooncake.store", reason="needs the mooncake extra")
BIN = Path(mooncake.__file__).parent


class MooncakeStore:
    """``mooncake_master`` and one ``mooncake_client`` holding 256 MiB, on private ports."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-"))
        self.rpc, self.http = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        metadata = f"http://127.0.0.1:{self.http}/metadata"
        return f"mooncake://127.0.0.1:{self.rpc}?metadata={metadata}&local_host=127.0.0.1"

    def start_master(self) -> None:
        self._spawn(
            "master",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http}",
            f"--rpc_port={self.rpc}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={free_port()}",
        )

    def start_storage(self) -> None:
        self._spawn(
            "client",
            "--host=127.0.0.1",
            f"--port={free_port()}",
            "--global_segment_size=256MB",
            "--local_buffer_size=16MB",
            f"--master_server_address=127.0.0.1:{self.rpc}",
            f"--metadata_server=http://127.0.0.1:{self.http}/metadata",
            "--protocol=tcp",
            f"--http_port={free_port()}",
        )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _spawn(self, name: str, *args: str) -> None:
        with open(self.dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [str(BIN / f"mooncake_{name}"), *args], stdout=log, stderr=subprocess.STDOUT
            )


@pytest.fixture
def mooncake_store():
    ms = MooncakeStore()
    try:
        ms.start_master()
        ms.start_storage()
        yield ms
    finally:
        ms.close()


def open_tier(ms: MooncakeStore):
    tier = RemoteConfig(ms.url, settings=FAST).open_tier(SIGNATURE, BLOCK_BYTES)
    # Ready once the storage process has mounted its memory: a write goes through.
    probe = [block_hash("mooncake-probe", 0)]
    wait_until(lambda: store(tier, probe) == [True], "the store to take a block")
    return tier


def test_blocks_come_back_exact_and_are_not_written_twice(mooncake_store):
    tier = open_tier(mooncake_store)
    hashes = [block_hash("mooncake", i) for i in range(24)]
    try:
        assert store(tier, hashes, meta=lambda h: b"m" + h) == [True] * 24
        assert tier.lookup_prefix(hashes) == 24
        metas, outs = fetch(tier, hashes)
        assert metas == [b"m" + h for h in hashes]
        assert_exact(hashes, outs)
        stored = tier.counters.blocks_stored
        assert store(tier, hashes) == [True] * 24
        assert tier.counters.blocks_stored == stored and tier.counters.blocks_deduplicated == 24
        missing = block_hash("mooncake", 99)
        assert tier.lookup_prefix([*hashes[:3], missing]) == 3
        assert len(fetch(tier, [*hashes[:3], missing, hashes[4]])[0]) == 3
    finally:
        tier.close()


def test_a_foreign_value_is_a_counted_miss(mooncake_store):
    tier = open_tier(mooncake_store)
    config = RemoteConfig(mooncake_store.url)
    raw = config.open_backend(2 * BLOCK_BYTES)
    a, b = block_hash("foreign", 0), block_hash("foreign", 1)
    prefix = check_prefix(key_prefix(SIGNATURE))
    try:
        store(tier, [b])
        (route,) = raw.routes([block_key(prefix, b)])
        (value_of_b,) = raw.get(route, [block_key(prefix, b)])
        assert raw.put(route, [(block_key(prefix, a), (bytes(value_of_b),))]) == [True]
        assert tier.lookup_prefix([a, b]) == 2
        assert fetch(tier, [a, b])[0] == []
        assert tier.counters.checksum_failures == 1
    finally:
        raw.close()
        tier.close()


def test_a_store_without_room_drops_blocks_and_keeps_its_route_open():
    ms = MooncakeStore()
    ms.start_master()  # no storage process yet: no segment, no room
    tier = RemoteConfig(ms.url, settings=FAST).open_tier(SIGNATURE, BLOCK_BYTES)
    hashes = [block_hash("no-room", i) for i in range(3)]
    try:
        for _ in range(3):  # FAST opens the breaker after two failed calls
            assert store(tier, hashes) == [False] * 3
        assert tier.counters.breaker_trips == 0 and tier.open_routes() == []
        ms.start_storage()
        wait_until(lambda: store(tier, hashes) == [True] * 3, "the storage process to mount")
        assert_exact(hashes, fetch(tier, hashes)[1])
    finally:
        tier.close()
        ms.close()


def test_master_killed_gives_misses_opens_the_breaker_and_recovers(mooncake_store):
    tier = open_tier(mooncake_store)
    hashes = [block_hash("master", i) for i in range(4)]
    trips = tier.counters.breaker_trips
    try:
        store(tier, hashes)
        mooncake_store.kill("master")
        assert tier.lookup_prefix(hashes) == 0
        wait_until(lambda: tier.lookup_prefix(hashes) == 0 and tier.open_routes(), "breaker")
        assert fetch(tier, hashes)[0] == []
        dropped = []
        tier.write_behind(hashes[0], b"\0" * BLOCK_BYTES, b"", dropped.append)
        assert dropped == [False]
        assert tier.counters.fault_misses > 0 and tier.counters.breaker_trips == trips + 1

        mooncake_store.start_master()  # the storage process joins the new master
        wait_until(lambda: not tier.open_routes(), "the probe to close the breaker")
        wait_until(lambda: store(tier, hashes) == [True] * 4, "writes to go through again")
        metas, outs = fetch(tier, hashes)
        assert len(metas) == 4
        assert_exact(hashes, outs)
    finally:
        tier.close()
