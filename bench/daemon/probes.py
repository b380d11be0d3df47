"""What ``kvtier bench daemon`` measures against a running daemon: lookup latency, the RPC
floor, arena copy rates, write-behind stores with the disk tier on, and small lookups under a
heavy client's load. Each function talks to the daemon at ``target`` through ``DaemonClient``.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.client.index_reader import load_probe

SIGNATURE = xxhash.xxh3_128_digest(b"kvtier bench daemon")
SMALL_LOOKUP_HASHES = 16


def require_compiled_probe() -> None:
    """Waits for the lookup index's compiled probe, which a client loads on a thread of its
    own (its lookups are calls until then): a bench timing probes must not time calls."""
    if not load_probe():
        raise RuntimeError("no compiled probe of the lookup index (is numba installed?)")


def hashes_for(count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(count)]


def lookup_worker(target: str, block_bytes: int, count: int, lookups: int, out) -> None:
    client = DaemonClient(SIGNATURE, block_bytes, block_tokens=16, target=target, timeout_s=30)
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
        stored.append(copy_into_slots(client, rows))

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
    nbytes = total * block_bytes
    return {
        "store_gbps": nbytes / (t1 - t0) / 1e9,
        "load_gbps": nbytes / (t2 - t1) / 1e9,
        "memcpy_gbps": row_copy_gbps(dst, src),
    }


def row_copy_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
    """GB/s of copying ``src`` into ``dst`` one row (block) at a time, as stores copy."""
    start = time.perf_counter()
    for i in range(src.shape[0]):
        dst[i].copy_(src[i])
    return src.numel() / (time.perf_counter() - start) / 1e9


def drain_seconds(client: DaemonClient, timeout: float = 600.0) -> float:
    """Seconds until the daemon reports no committed block still being written to disk."""
    start = time.perf_counter()
    while True:
        stats = client.tools.stats()
        if stats is not None and not sum(layout.writing_behind for layout in stats.layouts):
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise RuntimeError("the disk tier did not drain")
        time.sleep(0.002)


def store_commit_rates(
    client: DaemonClient, batch: int, rounds: int, bursts: int = 3
) -> dict[str, float]:
    """Write-behind stores into a daemon WITH a disk tier: a burst's store rate, then how
    fast the disk drained it behind the commits (the median of ``bursts`` bursts: one lasts
    tens of milliseconds, short enough for the machine's other work to sway it).

    A burst goes as the connector's worker stores: the next batch's Reserve and the last
    batch's Commit run on helper threads while this batch is copied into its slots, so the
    rate is the copies' and not the round trips' (``store_gbps`` times them one after another).
    """
    block_bytes = client.block_bytes
    src = torch.randint(0, 256, (batch * rounds, block_bytes), dtype=torch.uint8)
    for i in range(rounds):  # warm the slots: a burst into a fresh arena pays page faults
        copy_into_slots(client, src[i * batch : (i + 1) * batch])
    drain_seconds(client)
    timed = [_store_burst(client, src, batch, rounds) for _ in range(bursts)]
    nbytes = src.numel()
    return {
        "store_commit_gbps": nbytes / statistics.median(t[0] for t in timed) / 1e9,
        "disk_drain_gbps": nbytes / statistics.median(t[1] for t in timed) / 1e9,
    }


def _store_burst(
    client: DaemonClient, src: torch.Tensor, batch: int, rounds: int
) -> tuple[float, float]:
    """Seconds to store ``src`` as new blocks, and until the disk had written them all."""
    hashes = [[uuid.uuid4().bytes for _ in range(batch)] for _ in range(rounds)]
    with ThreadPoolExecutor(1) as reserver, ThreadPoolExecutor(1) as committer:
        start = time.perf_counter()
        ahead = reserver.submit(client.reserve, hashes[0])
        commits = []
        for i in range(rounds):
            slots = ahead.result()
            if min(slots) < 0:
                raise RuntimeError(f"reserve refused: {slots}")
            if i + 1 < rounds:
                ahead = reserver.submit(client.reserve, hashes[i + 1])
            for row, slot in zip(src[i * batch : (i + 1) * batch], slots, strict=True):
                client.slab[slot].copy_(row)
            commits.append(committer.submit(client.commit, slots))
        if not all(commit.result() for commit in commits):
            raise RuntimeError("commit failed")
        stored = time.perf_counter() - start
    return stored, stored + drain_seconds(client)


def copy_into_slots(client: DaemonClient, rows: torch.Tensor) -> list[bytes]:
    """Stores each row as a new block (Reserve, one copy per block, Commit); returns hashes."""
    hashes = [uuid.uuid4().bytes for _ in range(rows.shape[0])]
    slots = client.reserve(hashes)
    if min(slots) < 0:
        raise RuntimeError(f"reserve refused: {slots}")
    for row, slot in zip(rows, slots, strict=True):
        client.slab[slot].copy_(row)
    if not client.commit(slots):
        raise RuntimeError("commit failed")
    return hashes


def hammer_worker(target: str, block_bytes: int, count: int, going, stop, out) -> None:
    """Sends lookups of ``count`` hashes (all misses) until ``stop`` is set; sets ``going``
    once the first is answered."""
    client = DaemonClient(SIGNATURE, block_bytes, block_tokens=16, target=target, timeout_s=30)
    try:
        if not client.wait_connected(60):
            raise RuntimeError("no daemon session")
        hashes = [uuid.uuid4().bytes for _ in range(count)]
        sent = 0
        while not stop.is_set():
            client.lookup(hashes)
            sent += 1
            going.set()
        out.put(sent)
    finally:
        client.close()


def small_lookup_p99_ms(
    target: str, block_bytes: int, other_hashes: int, lookups: int, interval_s: float = 0.0
) -> float:
    """p99 of a small host-hit lookup while another process keeps sending lookups of
    ``other_hashes`` misses; one every ``interval_s`` (as an engine's steps ask), or back to
    back with 0."""
    ctx = multiprocessing.get_context("spawn")
    going, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    hammer = ctx.Process(
        target=hammer_worker, args=(target, block_bytes, other_hashes, going, stop, out)
    )
    hammer.start()
    client = DaemonClient(SIGNATURE, block_bytes, block_tokens=16, target=target, timeout_s=30)
    try:
        if not client.wait_connected(60):
            raise RuntimeError("no daemon session")
        hashes = hashes_for(SMALL_LOOKUP_HASHES)
        if not going.wait(120):
            raise RuntimeError("the other client never got an answer")
        times = []
        begin = time.perf_counter()
        for i in range(lookups):
            ahead = begin + i * interval_s - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            start = time.perf_counter()
            hits = client.lookup(hashes)
            times.append(time.perf_counter() - start)
        if hits.host != len(hashes) or client.failures:
            raise RuntimeError(f"small lookups missed: {hits} failures={client.failures}")
    finally:
        stop.set()
        sent = out.get(timeout=120)
        hammer.join(60)
        client.close()
    if not sent:
        raise RuntimeError("the other client sent nothing")
    times.sort()
    return times[int(0.99 * (len(times) - 1))] * 1e3
