"""``kvtier bench remote``: the remote tier's put and get rates beside raw pipelined SET/GET.

In one run, against the same store, with 2 MiB blocks:

* the limit: raw pipelined ``SET``/``GET`` of plain 2 MiB values through the same client and
  connections (the backend's own batch calls, no header, no checksum, no copy), the better of
  one pipeline of every block per node (every node at once) and the tier's own split
  (pipelines of ``pipeline_blocks``, ``connections`` at once per node);
* the tier: ``write_behind`` of every block then ``flush`` (header, checksum, the dedup
  ``EXISTS`` round trip, the queue and the writer), and ``get_into`` the caller's buffers (header
  and checksum checked, payload copied out); each block checked bit-exact afterwards;
* ``lookup_ms``: one ``lookup_prefix`` of every block's hash.

``remote_put_ratio`` and ``remote_get_ratio`` divide the tier's rates by the raw ones. Each
figure is the best of ``--rounds``, fresh keys each round (so nothing is deduplicated). The
benchmark starts its own ``redis-server`` unless ``--remote`` names a store (any URL the daemon
takes: a server, a cluster, or Mooncake).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvtier.bench.limits import GB
from kvtier.bench.redis_server import RedisProcess
from kvtier.tiers.remote.backend import RemoteBackend
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.format import (
    MAX_META_BYTES,
    block_key,
    check_prefix,
    key_prefix,
    value_size,
)
from kvtier.tiers.remote.tier import RemoteSettings, RemoteTier

log = logging.getLogger(__name__)

BLOCK_BYTES = 2 << 20
SIGNATURE = bytes(range(16))
AIMS = {"remote_put_ratio": 0.8, "remote_get_ratio": 0.8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote", help="store URL (default: start a private redis-server)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per round (2 MiB each)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best one counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _fresh_hashes(blocks: int) -> Callable[[], list[bytes]]:
    """Each call: ``blocks`` hashes never used before (by this run or an earlier one)."""
    counter = iter(range(1 << 62))

    def fresh() -> list[bytes]:
        stamp = (time.time_ns() << 20 | next(counter)).to_bytes(12, "little")
        return [stamp + i.to_bytes(4, "little") for i in range(blocks)]

    return fresh


class _Raw:
    """Raw batches of plain values through the backend's own calls: pipelines of ``chunk``
    values, ``per_route`` of them at once on each route, every route at once."""

    def __init__(self, backend: RemoteBackend, values: np.ndarray, chunk: int, per_route: int):
        self._backend = backend
        self._values = values
        self._chunk = chunk
        self._per_route = per_route
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def set(self, keys: list[bytes]) -> None:
        calls = [
            self._submit(r, self._backend.put, [(keys[i], (self._values[i],)) for i in idx])
            for r, idx in _by_route(self._backend, keys, self._chunk)
        ]
        if not all(all(call.result()) for call in calls):
            raise RuntimeError("the store refused raw SETs")

    def get(self, keys: list[bytes]) -> None:
        calls = {
            self._submit(r, self._backend.get, [keys[i] for i in idx]): idx
            for r, idx in _by_route(self._backend, keys, self._chunk)
        }
        for call, idx in calls.items():
            for i, value in zip(idx, call.result(), strict=True):
                if value is None or memoryview(value).nbytes != self._values[i].nbytes:
                    raise RuntimeError("raw GET returned other bytes than were SET")

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()

    def _submit(self, route: str, fn: Callable, *args: object) -> Future:
        if route not in self._pools:
            self._pools[route] = ThreadPoolExecutor(self._per_route)
        return self._pools[route].submit(fn, route, *args)


def _by_route(backend: RemoteBackend, keys: Sequence[bytes], chunk: int) -> list[tuple[str, list]]:
    groups: dict[str, list[int]] = {}
    for i, route in enumerate(backend.routes(keys)):
        groups.setdefault(route, []).append(i)
    return [(r, idx[s : s + chunk]) for r, idx in groups.items() for s in range(0, len(idx), chunk)]


def _delete(backend: RemoteBackend, keys: list[bytes]) -> None:
    for route, idx in _by_route(backend, keys, len(keys)):
        backend.delete(route, [keys[i] for i in idx])


def _seconds(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(config: RemoteConfig, blocks: int, rounds: int) -> dict[str, float]:
    """Each round times raw SET and GET (both splits), then the tier's put and get, back to
    back, so that whatever else the machine does weighs on both; the best round of each
    counts."""
    settings = config.settings
    backend = config.open_backend(value_size(BLOCK_BYTES, MAX_META_BYTES))
    prefix = check_prefix(key_prefix(SIGNATURE))
    tier = RemoteTier(backend, SIGNATURE, BLOCK_BYTES, key_prefix(SIGNATURE), settings)
    data = np.random.default_rng(0).integers(0, 256, (blocks, BLOCK_BYTES), dtype=np.uint8)
    outs = np.ones_like(data)  # touched: page faults are not the tier's
    raws = [
        _Raw(backend, data, blocks, 1),
        _Raw(backend, data, settings.pipeline_blocks, settings.connections),
    ]
    fresh = _fresh_hashes(blocks)
    best = dict.fromkeys(("raw_set", "raw_get", "put", "get"), float("inf"))

    def keys_of(hashes: list[bytes]) -> list[bytes]:
        return [block_key(prefix, h) for h in hashes]

    def put(hashes: list[bytes]) -> None:
        done: list[bool] = []
        for h, row in zip(hashes, data, strict=True):
            tier.write_behind(h, row, b"", done.append)
        tier.flush()
        if done != [True] * blocks:
            raise RuntimeError(f"the tier stored {sum(done)} of {blocks} blocks")

    def get(hashes: list[bytes]) -> None:
        if len(tier.get_into(hashes, list(outs))) != blocks:
            raise RuntimeError("the tier missed blocks it had stored")

    try:
        for _ in range(rounds):
            for raw in raws:
                keys = keys_of(fresh())
                best["raw_set"] = min(best["raw_set"], _seconds(raw.set, keys))
                best["raw_get"] = min(best["raw_get"], _seconds(raw.get, keys))
                _delete(backend, keys)
            hashes = fresh()
            best["put"] = min(best["put"], _seconds(put, hashes))
            best["get"] = min(best["get"], _seconds(get, hashes))
            if not np.array_equal(outs, data):
                raise RuntimeError("the tier returned other bytes than were stored")
            lookups = [_seconds(tier.lookup_prefix, hashes) for _ in range(20)]
            if tier.lookup_prefix(hashes) != blocks:
                raise RuntimeError("a lookup missed stored blocks")
            _delete(backend, keys_of(hashes))
    finally:
        for raw in raws:
            raw.close()
        tier.close()
    total = blocks * BLOCK_BYTES
    result = {
        "blocks": blocks,
        "block_bytes": BLOCK_BYTES,
        "raw_set_gbps": total / best["raw_set"] / GB,
        "raw_get_gbps": total / best["raw_get"] / GB,
        "remote_put_gbps": total / best["put"] / GB,
        "remote_get_gbps": total / best["get"] / GB,
        "lookup_ms": statistics.median(lookups) * 1000,
    }
    result["remote_put_ratio"] = result["remote_put_gbps"] / result["raw_set_gbps"]
    result["remote_get_ratio"] = result["remote_get_gbps"] / result["raw_get_gbps"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def run(args: argparse.Namespace) -> int:
    settings = RemoteSettings(queue_bytes=args.blocks * BLOCK_BYTES, transfer_timeout_s=60)
    if args.remote:
        source = args.remote
        result = measure(RemoteConfig(args.remote, settings=settings), args.blocks, args.rounds)
    else:
        # Room for a few rounds at once, so the LRU never evicts what a round is about to read.
        with RedisProcess(maxmemory=8 * args.blocks * BLOCK_BYTES + (256 << 20)) as server:
            source = f"own redis-server on {server.address}"
            result = measure(RemoteConfig(server.url, settings=settings), args.blocks, args.rounds)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvtier bench remote: {source}, {args.blocks} blocks of {BLOCK_BYTES >> 20} MiB")
    for key, value in result.items():
        aim = f"  (aim >= {AIMS[key]})" if key in AIMS else ""
        print(f"  {key:<18} {value:>10}{aim}")
    return 0
