"""``kvtier bench daemon``: lookup latency of a live daemon and copy rates through its arena.

Starts a daemon (a ``kvtier serve`` subprocess on private paths, host tier only, so the figures
are the daemon's own and not the disk's), stores ``--hashes`` blocks, then:

* N client processes each time ``--lookups`` Lookup calls of ``--hashes`` hashes that all hit
  (the longest walk): p50/p99 latency and aggregate lookups per second, beside
  ``rpc_floor_p50_ms``: the daemon's bare health Check, the least any gRPC call costs here;
* one client times store (Reserve → copy into the arena → Commit) and load (Acquire → copy out
  → Release) of batches of blocks, beside ``memcpy_gbps``: the same tensor copy between two
  private buffers measured in the same run. ``store_ratio``/``load_ratio`` divide by it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import torch
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.connector.client import DaemonClient
from kvtier.proto import contract

SIGNATURE = xxhash.xxh3_128_digest(b"kvtier bench daemon")
AIMS = {
    "lookup_p50_ms": 0.5,
    "lookup_p99_ms": 2.0,
    "lookups_per_s": 5000,
    "store_ratio": 0.8,
    "load_ratio": 0.8,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--clients", type=int, default=2, help="lookup client processes")
    parser.add_argument("--hashes", type=int, default=1000, help="hashes per lookup")
    parser.add_argument("--lookups", type=int, default=3000, help="lookups per client")
    parser.add_argument("--block-kib", type=int, default=2048, help="block size in KiB")
    parser.add_argument("--batch", type=int, default=32, help="blocks per store/load batch")
    parser.add_argument("--rounds", type=int, default=8, help="timed store/load batches")


def hashes_for(count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(count)]


def lookup_worker(target: str, block_bytes: int, count: int, lookups: int, out) -> None:
    client = DaemonClient(SIGNATURE, block_bytes, block_tokens=16, target=target)
    try:
        if not client.wait_connected(60):
            raise RuntimeError("no daemon session")
        hashes = hashes_for(count)
        for _ in range(50):  # warm the channel
            client.lookup(hashes)
        times = []
        for _ in range(lookups):
            start = time.perf_counter()
            hits = client.lookup(hashes)
            times.append(time.perf_counter() - start)
        if hits.total != count or client.failures:
            raise RuntimeError(f"lookups missed: {hits} failures={client.failures}")
        out.put(times)
    except Exception as exc:  # reported to the parent, which fails the benchmark with it
        out.put(repr(exc))
        raise
    finally:
        client.close()


def rpc_floor_ms(target: str, calls: int = 2000) -> float:
    """Median round trip of the daemon's standard health Check: the least any RPC costs here."""
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        request = health_pb2.HealthCheckRequest(service="")
        for _ in range(100):
            check(request, timeout=30)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            check(request, timeout=30)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copy_rates(client: DaemonClient, batch: int, rounds: int) -> dict[str, float]:
    """Store and load GB/s through the arena, and the private-memory memcpy rate beside them.

    Every timed batch moves distinct blocks between distinct private rows and distinct slots,
    so no rate is flattered by caches; memcpy moves the same bytes between two private buffers.
    Blocks move one ``copy_`` each, as the copy engine moves them to and from a GPU.
    """
    block_bytes = client.block_bytes
    total = batch * rounds
    src = torch.randint(0, 256, (total, block_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    stored: list[list[bytes]] = []

    def store(rows: torch.Tensor) -> None:
        hashes = [uuid.uuid4().bytes for _ in range(batch)]
        slots = client.reserve(hashes)
        if min(slots) < 0:
            raise RuntimeError(f"reserve refused: {slots}")
        for row, slot in zip(rows, slots, strict=True):
            client.slab[slot].copy_(row)
        if not client.commit(slots):
            raise RuntimeError("commit failed")
        stored.append(hashes)

    def load(hashes: list[bytes], rows: torch.Tensor) -> None:
        slots = client.acquire(hashes)
        if len(slots) != batch:
            raise RuntimeError("acquire missed")
        for row, slot in zip(rows, slots, strict=True):
            row.copy_(client.slab[slot])
        client.release(slots)

    batches = [slice(i * batch, (i + 1) * batch) for i in range(rounds)]
    dst.copy_(src)  # fault in the private buffers
    for rows in batches:  # and every slot of the mapping the timed rounds will use
        store(src[rows])
    stored.clear()
    t0 = time.perf_counter()
    for rows in batches:
        store(src[rows])
    t1 = time.perf_counter()
    for hashes, rows in zip(stored, batches, strict=True):
        load(hashes, dst[rows])
    t2 = time.perf_counter()
    if not torch.equal(dst, src):
        raise RuntimeError("loaded bytes differ from stored bytes")
    t3 = time.perf_counter()
    for rows in batches:
        for i in range(rows.start, rows.stop):
            dst[i].copy_(src[i])
    t4 = time.perf_counter()
    nbytes = total * block_bytes
    return {
        "store_gbps": nbytes / (t1 - t0) / 1e9,
        "load_gbps": nbytes / (t2 - t1) / 1e9,
        "memcpy_gbps": nbytes / (t4 - t3) / 1e9,
    }


def run(args: argparse.Namespace) -> int:
    # One thread per copy, like a copy stream: torch's intra-op pool makes 0.5 MiB copies
    # up to 100x slower on a busy 2-core machine (thread wake-ups, not bandwidth).
    torch.set_num_threads(1)
    block_bytes = args.block_kib << 10
    slots = args.hashes + 2 * args.batch * args.rounds
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/tmp"))
    name = f"bench-{uuid.uuid4().hex[:8]}"
    socket = root / "d.sock"
    target = contract.unix_target(socket)
    cmd = [
        sys.executable,
        "-m",
        "kvtier.service.serve",
        "--name",
        name,
        "--socket",
        str(socket),
        "--data-dir",
        str(root / "data"),
        "--host-bytes",
        str(slots * block_bytes),
        "--disk-bytes",
        "0",
        "--stats-port",
        "-1",
    ]
    with open(root / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = DaemonClient(
            SIGNATURE,
            block_bytes,
            block_tokens=16,
            target=target,
            timeout_s=30,
            client_name="bench",
        )
        if not client.wait_connected(60):
            raise RuntimeError(f"daemon did not come up: {(root / 'daemon.log').read_text()}")
        rates = copy_rates(client, args.batch, args.rounds)
        floor_ms = rpc_floor_ms(target)
        hashes = hashes_for(args.hashes)
        for i in range(0, len(hashes), args.batch):
            chunk = hashes[i : i + args.batch]
            if not client.commit(client.reserve(chunk)):
                raise RuntimeError("could not store the lookup blocks")
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=lookup_worker, args=(target, block_bytes, args.hashes, args.lookups, out)
            )
            for _ in range(args.clients)
        ]
        start = time.perf_counter()
        for p in procs:
            p.start()
        results = [out.get(timeout=300) for _ in procs]
        failed = [r for r in results if isinstance(r, str)]
        if failed:
            raise RuntimeError(f"lookup clients failed: {failed}")
        times = [t for r in results for t in r]
        wall = time.perf_counter() - start
        for p in procs:
            p.join()
        client.close()
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    times.sort()
    # the wall time includes process start-up; per-client busy time is the fairer divisor
    busy = max(sum(r) for r in results)
    figures = {
        "lookup_p50_ms": statistics.median(times) * 1e3,
        "lookup_p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
        "lookups_per_s": len(times) / busy,
        "rpc_floor_p50_ms": floor_ms,
        "lookup_vs_floor": statistics.median(times) * 1e3 / floor_ms,
        **rates,
        "store_ratio": rates["store_gbps"] / rates["memcpy_gbps"],
        "load_ratio": rates["load_gbps"] / rates["memcpy_gbps"],
        "clients": args.clients,
        "hashes_per_lookup": args.hashes,
        "block_bytes": block_bytes,
        "batch_blocks": args.batch,
        "wall_s": wall,
    }
    if args.json:
        print(
            json.dumps(
                {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()},
                indent=2,
            )
        )
        return 0
    for key, value in figures.items():
        aim = AIMS.get(key)
        note = f"   (aim {'<=' if key.endswith('_ms') else '>='} {aim})" if aim else ""
        print(
            f"{key:>18}  {value:12.3f}{note}"
            if isinstance(value, float)
            else f"{key:>18}  {value:12d}"
        )
    return 0
