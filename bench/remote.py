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
from kvtier.tiers.remote import RemoteSettings, RemoteTier
from kvtier.tiers.remote_backend import RemoteBackend
from kvtier.tiers.remote_config import RemoteConfig
from kvtier.tiers.remote_format import (
    MAX_META_BYTES,
    block_key,
    check_prefix,
    key_prefix,
    value_size,
)

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


def _best(rounds: int, prepare: Callable[[], object], timed: Callable[[object], None]) -> float:
    """The fastest of ``rounds`` runs of ``timed(prepare())``, timing only ``timed``."""
    best = float("inf")
    for _ in range(rounds):
        arg = prepare()
        start = time.perf_counter()
        timed(arg)
        best = min(best, time.perf_counter() - start)
    return best


def _by_route(backend: RemoteBackend, keys: Sequence[bytes], chunk: int) -> list[tuple[str, list]]:
    groups: dict[str, list[int]] = {}
    for i, route in enumerate(backend.routes(keys)):
        groups.setdefault(route, []).append(i)
    return [(r, idx[s : s + chunk]) for r, idx in groups.items() for s in range(0, len(idx), chunk)]


def raw_seconds(
    backend: RemoteBackend,
    make_keys: Callable[[], list[bytes]],
    values: np.ndarray,
    settings: RemoteSettings,
    rounds: int,
) -> tuple[float, float]:
    """Best SET and GET seconds for every value, over both ways of splitting the batch."""
    whole = _raw_split(backend, make_keys, values, len(values), 1, rounds)
    split = _raw_split(
        backend, make_keys, values, settings.pipeline_blocks, settings.connections, rounds
    )
    return min(whole[0], split[0]), min(whole[1], split[1])


def _raw_split(
    backend: RemoteBackend,
    make_keys: Callable[[], list[bytes]],
    values: np.ndarray,
    chunk: int,
    per_route: int,
    rounds: int,
) -> tuple[float, float]:
    """SET and GET seconds with pipelines of ``chunk`` values, ``per_route`` of them at once
    on each route (every route at once), as the tier runs them."""
    written: list[list[bytes]] = []
    pools: dict[str, ThreadPoolExecutor] = {}

    def submit(route: str, fn: Callable, *args: object) -> Future:
        if route not in pools:
            pools[route] = ThreadPoolExecutor(per_route)
        return pools[route].submit(fn, route, *args)

    def fresh() -> list[bytes]:
        written.append(make_keys())
        return written[-1]

    def put(keys: list[bytes]) -> None:
        calls = [
            submit(r, backend.put, [(keys[i], memoryview(values[i])) for i in idx])
            for r, idx in _by_route(backend, keys, chunk)
        ]
        if not all(all(c.result()) for c in calls):
            raise RuntimeError("the store refused raw SETs")

    def get(keys: list[bytes]) -> None:
        calls = {
            submit(r, backend.get, [keys[i] for i in idx]): idx
            for r, idx in _by_route(backend, keys, chunk)
        }
        for call, idx in calls.items():
            for i, value in zip(idx, call.result(), strict=True):
                if value is None or memoryview(value).nbytes != values[i].nbytes:
                    raise RuntimeError("raw GET returned other bytes than were SET")

    def stored() -> list[bytes]:
        keys = fresh()
        put(keys)
        return keys

    try:
        set_s = _best(rounds, fresh, put)
        get_s = _best(rounds, stored, get)
    finally:
        for pool in pools.values():
            pool.shutdown()
    for keys in written:
        _delete(backend, keys)
    return set_s, get_s


def _delete(backend: RemoteBackend, keys: list[bytes]) -> None:
    for route, idx in _by_route(backend, keys, len(keys)):
        backend.delete(route, [keys[i] for i in idx])


def measure(config: RemoteConfig, blocks: int, rounds: int) -> dict[str, float]:
    settings = config.settings
    backend = config.open_backend(value_size(BLOCK_BYTES, MAX_META_BYTES))
    prefix = check_prefix(key_prefix(SIGNATURE))
    tier = RemoteTier(backend, SIGNATURE, BLOCK_BYTES, key_prefix(SIGNATURE), settings)

    def keys_of(hashes: list[bytes]) -> list[bytes]:
        return [block_key(prefix, h) for h in hashes]

    data = np.random.default_rng(0).integers(0, 256, (blocks, BLOCK_BYTES), dtype=np.uint8)
    outs = np.ones_like(data)  # touched: page faults are not the tier's
    try:
        fresh_hashes = _fresh_hashes(blocks)
        raw_set_s, raw_get_s = raw_seconds(
            backend, lambda: keys_of(fresh_hashes()), data, settings, rounds
        )

        def put(round_hashes: list[bytes]) -> None:
            done: list[bool] = []
            for h, row in zip(round_hashes, data, strict=True):
                tier.write_behind(h, row, b"", done.append)
            tier.flush()
            if done != [True] * blocks:
                raise RuntimeError(f"the tier stored {sum(done)} of {blocks} blocks")

        put_hashes: list[list[bytes]] = []

        def fresh() -> list[bytes]:
            put_hashes.append(fresh_hashes())
            return put_hashes[-1]

        put_s = _best(rounds, fresh, put)

        def get(round_hashes: list[bytes]) -> None:
            if len(tier.get_into(round_hashes, list(outs))) != blocks:
                raise RuntimeError("the tier missed blocks it had stored")

        get_s = _best(rounds, lambda: put_hashes[-1], get)
        if not np.array_equal(outs, data):
            raise RuntimeError("the tier returned other bytes than were stored")
        lookups = []
        for _ in range(20):
            start = time.perf_counter()
            if tier.lookup_prefix(put_hashes[-1]) != blocks:
                raise RuntimeError("a lookup missed stored blocks")
            lookups.append(time.perf_counter() - start)
        for round_hashes in put_hashes:
            _delete(backend, keys_of(round_hashes))
    finally:
        tier.close()
    total = blocks * BLOCK_BYTES
    result = {
        "blocks": blocks,
        "block_bytes": BLOCK_BYTES,
        "raw_set_gbps": total / raw_set_s / GB,
        "raw_get_gbps": total / raw_get_s / GB,
        "remote_put_gbps": total / put_s / GB,
        "remote_get_gbps": total / get_s / GB,
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
