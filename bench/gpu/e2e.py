"""Stores and loads end to end through a real daemon, for ``kvtier bench gpu``.

Where ``connector.py`` times the copies alone, into an arena mapped in-process, this times
what a vLLM worker pays per request: the daemon's calls around the copies. A ``kvtier serve``
subprocess owns the host tier; two client processes, each with its own CUDA context and a
vLLM-shaped ``BLHNC`` KV buffer, run the connector's call sequence at once:

* store: slots reserved ahead (no call; the client asks for more on its own thread) → copy
  the blocks into their slots on the store stream → Commit, sent without waiting for its
  answer, once the bytes are in;
* load: Lookup (from the daemon's shared-memory index, as the scheduler reads it) → Acquire →
  copy the slots into GPU blocks on the load stream → Release once the copy has read them.

As the vLLM worker runs them: the next request's slots (or its Lookup and Acquire) are taken
on a helper thread while this request's blocks copy, and Commits and Releases are sent from
another helper thread when the copy engine's ``poll`` finds a transfer done, so the engine's
thread only queues copies. The daemon is asked to reserve each client two requests' blocks
ahead (``--reserve-ahead-blocks``), one taken while the next are reserved; it keeps at most
a thirty-second of its slots ahead, so in an arena of a few requests per client a store
often finds too few and reserves by hash, as the worker does then. Each figure is the bytes
both clients moved over the wall time from the first call to the last answer in
(``time.monotonic``, one clock for every process on the host), beside the PCIe ceiling
measured in the same run. ``load4_ms`` is one 4-block load
from its Lookup to its copies done, the latency a request waits for a short hit.
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvtier.bench.daemon.command import start_daemon
from kvtier.bench.daemon.probes import require_compiled_probe
from kvtier.bench.gpu.connector import vllm_placement
from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.layout import KVLayout

CLIENTS = 2
SMALL_LOAD_BLOCKS = 4


@dataclass(frozen=True)
class EndToEnd:
    blocks_per_request: int
    store_gbps: float
    load_gbps: float
    load4_ms: float
    """Median of one 4-block load from its Lookup to its copies done."""
    load4_parts_ms: tuple[float, float, float]
    """Medians of that load's parts: the Lookup (an index probe), the Acquire, the copy."""
    exact: bool


def _hashes(client_index: int, request: int, count: int) -> list[bytes]:
    """Block hashes as the connector makes them: xxh3 output, one chain per request."""
    seed = f"e2e {client_index} {request}".encode()
    return [xxhash.xxh3_128_digest(seed + i.to_bytes(8, "little")) for i in range(count)]


def _client(
    target: str,
    layout: KVLayout,
    index: int,
    blocks: int,
    requests: int,
    small_loads: int,
    device: str,
    barrier,
    out,
) -> None:
    """One engine's worker: stores ``requests`` requests of ``blocks`` blocks, loads them back
    into other GPU blocks, then times ``small_loads`` 4-block loads."""
    try:
        client = DaemonClient(
            layout.signature,
            layout.block_bytes,
            block_tokens=layout.block_size,
            target=target,
            timeout_s=30,
            client_name=f"bench-e2e-{index}",
            lookup_index=True,
            reserve_ahead=True,
        )
        if not client.wait_connected(60):
            raise RuntimeError("the daemon did not come up")
        require_compiled_probe()
        placement = vllm_placement(layout, 2 * requests * blocks, "BLHNC", device)
        engine = CopyEngine(placement, client.slab)
        sent = [_hashes(index, r, blocks) for r in range(requests)]
        gpu_out = [list(range(r * blocks, (r + 1) * blocks)) for r in range(requests)]
        gpu_in = [[requests * blocks + b for b in ids] for ids in gpu_out]
        # the first copy page-locks the arena: not a request's cost
        warm = client.reserve(_hashes(index, requests, 1))
        engine.store([0], warm).wait()
        client.commit(warm)

        ahead = ThreadPoolExecutor(1, thread_name_prefix="e2e-ahead")
        behind = ThreadPoolExecutor(1, thread_name_prefix="e2e-behind")

        def reserve(hashes: list[bytes]) -> list[int]:
            slots = client.reserve(hashes)
            if min(slots) < 0:
                raise RuntimeError(f"reserve refused: {slots}")
            return slots

        def acquire(hashes: list[bytes]) -> list[int]:
            if client.lookup(hashes).total != len(hashes):
                raise RuntimeError("lookup missed a stored block")
            slots = client.acquire(hashes)
            if len(slots) != len(hashes):
                raise RuntimeError("acquire missed a stored block")
            return slots

        def overlapped(ask, copy, answer) -> tuple[float, float]:
            """Every request: ``ask`` for its slots one request ahead, queue ``copy``, and send
            ``answer`` once the copy is done; returns the wall span until every answer is in."""
            answers: list[Future] = []
            start = time.monotonic()
            pending = ahead.submit(ask, sent[0])
            for r in range(requests):
                slots = pending.result()
                if r + 1 < requests:
                    pending = ahead.submit(ask, sent[r + 1])
                copy(r, slots, lambda s=slots: answers.append(behind.submit(answer, s)))
                engine.poll()
            engine.synchronize()
            for done in answers:
                if done.result() is False:
                    raise RuntimeError("commit failed")
            return start, time.monotonic()

        committed: list[bool] = []

        def commit(slots: list[int]) -> None:
            client.commit_later(slots, lambda ok, not_stored: committed.append(ok))

        barrier.wait()
        store_start, _ = overlapped(
            reserve,
            lambda r, slots, done: engine.store(gpu_out[r], slots, callback=done),
            commit,
        )
        # the span ends with the last Commit's answer, which was sent without waiting
        if not client.settle(60) or len(committed) != requests or not all(committed):
            raise RuntimeError(f"commits failed: {committed}, {client.failures} failed calls")
        store_end = time.monotonic()
        barrier.wait()
        load_start, load_end = overlapped(
            acquire,
            lambda r, slots, done: engine.load(slots, gpu_in[r], callback=done),
            client.release,
        )
        ahead.shutdown()
        behind.shutdown()

        small = []
        for n in range(small_loads):
            hashes = sent[n % requests][:SMALL_LOAD_BLOCKS]
            t0 = time.perf_counter()
            client.lookup(hashes)
            t1 = time.perf_counter()
            slots = client.acquire(hashes)
            t2 = time.perf_counter()
            engine.load(slots, gpu_in[0][:SMALL_LOAD_BLOCKS]).wait()
            t3 = time.perf_counter()
            small.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
            client.release(slots)
        # request 0's blocks took the small loads; every other one must have come back whole
        stored_ids = [i for ids in gpu_out[1:] for i in ids]
        loaded_ids = [i for ids in gpu_in[1:] for i in ids]
        want = torch.empty((len(stored_ids), layout.block_bytes), dtype=torch.uint8, device=device)
        back = torch.empty_like(want)
        placement.gather(torch.tensor(stored_ids, device=device), want)
        placement.gather(torch.tensor(loaded_ids, device=device), back)
        exact = bool(stored_ids) and torch.equal(want, back)
        engine.close()
        client.close()
        out.put((store_start, store_end, load_start, load_end, small, exact))
    except Exception as exc:  # the parent reports it; a hung barrier would hide it
        barrier.abort()
        out.put(f"client {index}: {exc!r}")


def end_to_end(
    layout: KVLayout, blocks: int, requests: int, small_loads: int, device: str = "cuda"
) -> EndToEnd:
    """Both clients' store and load rates through one real daemon, and a small load's latency."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as root:
        host_bytes = CLIENTS * (requests + 1) * blocks * layout.block_bytes + (64 << 20)
        daemon, target = start_daemon(
            Path(root), host_bytes, 0, ("--reserve-ahead-blocks", str(2 * blocks))
        )
        try:
            barrier, out = ctx.Barrier(CLIENTS), ctx.Queue()
            procs = [
                ctx.Process(
                    target=_client,
                    args=(target, layout, i, blocks, requests, small_loads, device, barrier, out),
                )
                for i in range(CLIENTS)
            ]
            for p in procs:
                p.start()
            results = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
        finally:
            daemon.terminate()
            daemon.wait(30)
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"end-to-end clients failed: {failed}")
    moved = CLIENTS * requests * blocks * layout.block_bytes
    store_s = max(r[1] for r in results) - min(r[0] for r in results)
    load_s = max(r[3] for r in results) - min(r[2] for r in results)
    small = [s for r in results for s in r[4]]
    medians = [statistics.median(part) * 1e3 for part in zip(*small, strict=True)] or [0.0] * 4
    return EndToEnd(
        blocks,
        moved / store_s / 1e9,
        moved / load_s / 1e9,
        medians[0],
        (medians[1], medians[2], medians[3]),
        all(r[5] for r in results),
    )
