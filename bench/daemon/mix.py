"""``kvtier bench daemon --clients N``: N client processes doing the vLLM connector's calls,
paced as engines pace them.

Each client sends ``rate`` requests per second on a fixed schedule (not a tight loop: an
engine asks once per request it schedules, and N engines on a node ask independently, so the
clients' schedules are staggered). One request is what the connector does for a prompt:

* a Lookup of the daemon's ``hashes`` stored blocks, all hits (the longest walk);
* a load: Acquire of ``SLOT_BLOCKS`` of those blocks → copy each out of the arena → Release;
* a store: Reserve ``SLOT_BLOCKS`` new blocks → copy each into its slot → Commit.

Each call is timed on its own, copies left out: a slot operation is a Reserve+Commit or an
Acquire+Release timed as one. A client stores as the connector's worker does: into slots its
session reserved ahead (the Reserve is no call, and asks for more on the client's own thread;
the lookup index tells it which blocks are stored already), its Commit sent without waiting
for the answer. Release is sent without waiting too; the next Reserve or Acquire waits for
it. A client that misses a call's deadline, a hit or a slot fails the benchmark; the
deadlines are long (30 s), so that a stall of a busy machine shows in the p99 rather than
ending the run.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
import uuid
from dataclasses import dataclass

import torch

from kvtier.bench.daemon.probes import SIGNATURE, hashes_for, require_compiled_probe
from kvtier.connector.client.daemon_client import DaemonClient

SLOT_BLOCKS = 4
"""Blocks per store and per load of the mix: a short prompt's new and loaded blocks."""


@dataclass(frozen=True)
class MixPlan:
    target: str
    block_bytes: int
    hashes: int
    """Blocks stored before the mix, named by every lookup (``hashes_for(hashes)``)."""
    rate: float
    """Requests per second per client."""
    seconds: float
    """How long each client keeps its schedule."""
    lookup_index: bool
    """Whether clients probe the daemon's lookup index (as the connector's scheduler does)."""


@dataclass
class ClientTimes:
    lookups: list[float]
    slot_ops: list[float]
    block_ops: int
    """Blocks named by this client's answered calls: looked up, loaded and stored."""
    requests: int
    late: int
    """Requests begun more than one period after their scheduled time."""
    began: float
    ended: float


def mix_figures(plan: MixPlan, clients: int) -> dict[str, float]:
    """Runs ``clients`` mix clients at once against the daemon; their pooled figures.

    ``block_ops_per_s``: blocks named by every client's answered Lookup, Acquire and Reserve
    (a 1,000-hash lookup counts 1,000, a 4-block load or store 4) per second of the span from
    the first client's first request to the last client's last answer. While every client
    keeps its schedule this is ``clients * rate * (hashes + 2 * SLOT_BLOCKS)``; a daemon that
    cannot keep up gives less (and ``mix_late_fraction`` grows).
    """
    ctx = multiprocessing.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    begin = ctx.Value("d", 0.0)
    go = ctx.Event()
    procs = [
        ctx.Process(target=mix_client, args=(plan, i, clients, ready, go, begin, out))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        # Clients start up (spawn, imports, session) at their own pace; the schedule starts
        # once all are ready, so no client's start-up lands in another's timings.
        for _ in procs:
            _raise_if_failed(ready.get(timeout=300))
        begin.value = time.monotonic() + 0.2
        go.set()
        results = [out.get(timeout=300 + 2 * plan.seconds) for _ in procs]
        for result in results:
            _raise_if_failed(result)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    finally:
        for p in procs:
            p.join(60)
    lookups = sorted(t for r in results for t in r.lookups)
    slot_ops = sorted(t for r in results for t in r.slot_ops)
    span = max(r.ended for r in results) - min(r.began for r in results)
    requests = sum(r.requests for r in results)
    return {
        "lookup_p50_us": _quantile(lookups, 0.5) * 1e6,
        "lookup_p99_us": _quantile(lookups, 0.99) * 1e6,
        "slot_op_p50_us": _quantile(slot_ops, 0.5) * 1e6,
        "slot_op_p99_us": _quantile(slot_ops, 0.99) * 1e6,
        "block_ops_per_s": sum(r.block_ops for r in results) / span,
        "mix_requests_per_s": requests / span,
        "mix_late_fraction": sum(r.late for r in results) / requests,
    }


def mix_client(plan: MixPlan, index: int, clients: int, ready, go, begin, out) -> None:
    """One engine's calls on ``plan``'s schedule, offset by ``index / clients`` of a period."""
    torch.set_num_threads(1)
    client = DaemonClient(
        SIGNATURE,
        plan.block_bytes,
        block_tokens=16,
        target=plan.target,
        client_name=f"bench-mix-{index}",
        timeout_s=30,
        lookup_index=plan.lookup_index,
        reserve_ahead=True,
    )
    try:
        if not client.wait_connected(60):
            raise RuntimeError("no daemon session")
        if plan.lookup_index:
            require_compiled_probe()
        hashes = hashes_for(plan.hashes)
        rows = torch.randint(0, 256, (SLOT_BLOCKS, plan.block_bytes), dtype=torch.uint8)
        for i in range(3):  # warm the channel, the arena's pages and the copies
            _request(client, hashes, rows, i)
        ready.put(None)
        go.wait()
        period = 1.0 / plan.rate
        start = begin.value + period * index / clients
        times = ClientTimes([], [], 0, 0, 0, start, start)
        while True:
            due = start + times.requests * period
            now = time.monotonic()
            if due - start >= plan.seconds:
                break
            if now < due:
                time.sleep(due - now)
            elif now - due > period:
                times.late += 1
            lookup_s, slot_s = _request(client, hashes, rows, times.requests)
            times.lookups.append(lookup_s)
            times.slot_ops += slot_s
            times.block_ops += len(hashes) + 2 * SLOT_BLOCKS
            times.requests += 1
        times.ended = time.monotonic()
        if client.failures:
            raise RuntimeError(f"{client.failures} calls failed")
        out.put(times)
    except Exception as exc:  # reported to the parent, which fails the benchmark with it
        message = f"client {index}: {exc!r}"
        ready.put(message)
        out.put(message)
        raise
    finally:
        client.close()


def _request(
    client: DaemonClient, hashes: list[bytes], rows: torch.Tensor, request: int
) -> tuple[float, list[float]]:
    """One request's calls; the Lookup's seconds and the two slot operations' seconds."""
    t0 = time.perf_counter()
    hits = client.lookup(hashes)
    lookup_s = time.perf_counter() - t0
    if hits.host + hits.disk != len(hashes):
        raise RuntimeError(f"lookup missed: {hits}, failures={client.failures}")

    first = (request * SLOT_BLOCKS) % (len(hashes) - SLOT_BLOCKS + 1)
    t0 = time.perf_counter()
    slots = client.acquire(hashes[first : first + SLOT_BLOCKS])
    acquired = time.perf_counter() - t0
    if len(slots) != SLOT_BLOCKS:
        raise RuntimeError(f"acquire gave {len(slots)} of {SLOT_BLOCKS} slots")
    for row, slot in zip(rows, slots, strict=True):
        row.copy_(client.slab[slot])
    t0 = time.perf_counter()
    client.release(slots)
    load_s = acquired + time.perf_counter() - t0

    return lookup_s, [load_s, timed_store(client, rows, later=True)]


def timed_store(client: DaemonClient, rows: torch.Tensor, later: bool = False) -> float:
    """Stores ``rows`` as new blocks (Reserve, a copy per block, Commit; ``later``: the
    Commit sent without waiting); returns the seconds of its Reserve and Commit, the copies
    between them not counted."""
    hashes = [uuid.uuid4().bytes for _ in range(rows.shape[0])]  # the engine's, not a call's
    t0 = time.perf_counter()
    slots = client.reserve(hashes)
    reserved = time.perf_counter() - t0
    if min(slots) < 0:
        raise RuntimeError(f"reserve refused: {slots}")
    for row, slot in zip(rows, slots, strict=True):
        client.slab[slot].copy_(row)
    t0 = time.perf_counter()
    if later:
        client.commit_later(slots)
    elif not client.commit(slots):
        raise RuntimeError("commit failed")
    return reserved + time.perf_counter() - t0


def store_control_us(client: DaemonClient, batch: int, stores: int, later: bool = False) -> float:
    """Median client time of a ``batch``-block store beyond its copies: its Reserve and
    Commit, in microseconds (the copies run between them and are not counted); ``later``:
    each Commit sent without waiting, and every one of them confirmed at the end."""
    rows = torch.randint(0, 256, (batch, client.block_bytes), dtype=torch.uint8)
    # the first store warms the slots it lands in
    times = [timed_store(client, rows, later) for _ in range(stores + 1)]
    if not client.settle(60) or client.failures:
        raise RuntimeError(f"stores failed: {client.failures} failed calls")
    return statistics.median(times[1:]) * 1e6


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, math.floor(q * (len(ordered) - 1)))]


def _raise_if_failed(result: object) -> None:
    if isinstance(result, str):
        raise RuntimeError(f"mix client failed: {result}")
