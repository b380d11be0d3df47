"""Remote tier test helpers: real redis-server processes, a 3-node cluster, block contents."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable

import numpy as np
from redis.crc import key_slot

from kvtier.bench.redis_server import RedisProcess
from kvtier.tiers.remote.tier import RemoteSettings

from daemonutil import wait_until

SIGNATURE = bytes(range(16))
BLOCK_BYTES = 64 << 10
# Short waits, so that a fault is noticed quickly; nothing asserts on them.
FAST = RemoteSettings(
    lookup_timeout_s=1.0,
    transfer_timeout_s=2.0,
    failures_to_open=2,
    probe_interval_s=0.05,
    batch_blocks=8,
)
WAIT_S = 60.0


def block_hash(tag: str, i: int) -> bytes:
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}/{i}").bytes


def content(block_hash: bytes, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(block_hash[:8], "little"))
    return rng.integers(0, 256, block_bytes, dtype=np.uint8)


def store(tier, hashes: list[bytes], meta: Callable[[bytes], bytes] = lambda h: b"") -> list[bool]:
    """Writes the blocks through ``write_behind`` and waits for them; returns each on_done."""
    results: dict[bytes, bool] = {}
    blocks = {h: content(h, tier.block_bytes) for h in hashes}
    for h in hashes:
        tier.write_behind(h, blocks[h], meta(h), lambda ok, h=h: results.__setitem__(h, ok))
    tier.flush(WAIT_S)
    return [results[h] for h in hashes]


def fetch(tier, hashes: list[bytes]) -> tuple[list[bytes], list[np.ndarray]]:
    """``get_into`` fresh buffers; returns the metas and the buffers of the blocks fetched."""
    outs = [np.zeros(tier.block_bytes, np.uint8) for _ in hashes]
    metas = tier.get_into(hashes, outs)
    return metas, outs[: len(metas)]


def assert_exact(hashes: list[bytes], outs: list[np.ndarray]) -> None:
    for h, out in zip(hashes, outs, strict=False):
        np.testing.assert_array_equal(out, content(h, out.nbytes))


class LocalCluster:
    """Three (or ``size``) cluster-mode redis-servers joined into one cluster, no replicas."""

    def __init__(self, size: int = 3, maxmemory: int = 256 << 20) -> None:
        self.nodes = [RedisProcess(maxmemory=maxmemory, cluster=True) for _ in range(size)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def start(self) -> LocalCluster:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        for node in self.nodes:
            node.start()
        create = ["redis-cli", "--cluster", "create", *(n.address for n in self.nodes)]
        made = subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert made.returncode == 0, made.stdout + made.stderr
        wait_until(self.healthy, "the cluster to be ok on every node")

    def healthy(self) -> bool:
        for node in self.nodes:
            with node.client() as client:
                info = client.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or "cluster_slots_assigned:16384" not in text:
                return False
        return True

    def node_of(self, key: bytes) -> RedisProcess:
        """The node serving ``key``'s slot (asked of a live node)."""
        slot = key_slot(key)
        for node in self.nodes:
            if node.proc.poll() is not None:
                continue
            with node.client() as client:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = primary[1]
                        return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no live node knows slot {slot}")

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
