"""``kvtier bench daemon``: lookup latency of a live daemon and copy rates through its arena.

Starts a daemon (a ``kvtier serve`` subprocess on private paths, host tier only, so the figures
are the daemon's own and not the disk's), stores ``--hashes`` blocks, then:

* ``--clients`` processes do the vLLM connector's mix paced as engines pace them, ``--rate``
  requests per second each for ``--seconds`` (``mix``): per request a Lookup of the ``--hashes``
  stored blocks, a 4-block load and a 4-block store. ``lookup_p50_us``/``lookup_p99_us`` time
  its lookups, ``slot_op_p50_us``/``slot_op_p99_us`` its Reserve+Commit and Acquire+Release
  pairs (copies left out), ``block_ops_per_s`` the blocks its answered calls named per second
  (``mix.mix_figures`` defines it); the clients probe the daemon's lookup index and send the
  Lookup unwaited, as the connector's scheduler does (``--no-lookup-index``: every Lookup a
  call the client waits for);
* ``store_control_us``: one client's ``--batch``-block store, its time beyond the copies
  (its Reserve and Commit), median of ``--rounds``, stored as the connector's worker stores
  (into slots reserved ahead, the Commit sent without waiting); ``store_control_by_hash_us``
  the same store by hash, the Reserve and the Commit calls each waited for;
* ``--lookup-clients`` processes each time ``--lookups`` lookups of ``--hashes`` hashes that
  the index does not answer, back to back (``lookup_*_ms``): p50/p99 latency and aggregate
  lookups per second at full tilt, beside ``rpc_floor_p50_ms``: the daemon's bare health
  Check, the least any gRPC call costs here (the lookups go over the slot channel, which
  skips gRPC, where the daemon takes them there: ``lookup_vs_floor`` may be under 1);
* one client times store (Reserve → copy into the arena → Commit) and load (Acquire → copy out
  → Release) of batches of blocks, beside ``memcpy_gbps``: the same tensor copy between two
  private buffers measured in the same run. ``store_ratio``/``load_ratio`` divide by it;
* a second daemon WITH its disk tier times a burst of stores (``store_commit_gbps``, as a
  ratio to memcpy), pipelined as the connector's worker stores (the next Reserve and the last
  Commit on helper threads while a batch is copied): commits return once the blocks are
  readable in the host tier and the disk writes happen behind them, so the host tier should
  absorb a burst at memcpy speed. It then times the disk draining that burst
  (``disk_drain_gbps``) beside ``disk_raw_write_gbps``, sequential O_DIRECT writes to the
  same file system measured in the same run. Beside the burst's ratio to memcpy,
  ``memcpy_disk_busy_gbps`` is the same memcpy while a thread keeps the disk writing
  (``disk_writing``): on a small machine the disk's traffic slows every copy, and this is
  the ceiling for a store made while the disk drains;
* ``round_trip_hot_us``/``round_trip_idle_us`` and ``index_probe_hot_us``/``index_probe_idle_us``
  (``floors``): this machine's own cost of a round trip between two processes and of a probe of
  a ``--hashes`` lookup index, back to back and after an idle pause such as the paced clients
  take between requests; on a VM the idle ones are several times the others;
* ``daemon_{reserve,commit,acquire,release}_us_per_block`` (``per_block``): the daemon's own
  work per block of a ``--batch``-block call, in this process without the wire, its host tier
  full (each Reserve evicts what it takes): what grows with a store's or a load's length;
* ``daemon_notice_hot_us``/``daemon_notice_idle_us`` (``per_block``): the daemon's own work on
  a probed lookup's notice of ``--hashes`` stored blocks (at most 1,024) that its session's
  last notice holds already, as an engine's repeated lookups of a prefix find them, back to
  back and after an idle pause: what the slot operations' tail with many clients follows;
  ``daemon_notice_fresh_*`` the same with every hit held afresh (walked, pinned, held);
* ``small_lookup_p99_ms``: a 16-hash lookup's p99 while another client hammers the daemon
  with full-size lookups (heavy calls run on worker threads, so they must not stall it);
* ``small_lookup_p99_slow_remote_ms``: the same small host-hit lookup, one every 5 ms, its
  p99 while another client's lookups miss the host tier and wait on a remote store answering
  in 200 ms (a redis-server behind ``SlowProxy``): only what the host tier's memory answers
  runs on the daemon's event loop, so the wait must not reach it. Left out without
  ``redis-server``.
"""

from __future__ import annotations

import argparse
import contextlib
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

import torch

from kvtier.bench.daemon.floors import idle_floors
from kvtier.bench.daemon.mix import MixPlan, mix_figures, store_control_us
from kvtier.bench.daemon.per_block import per_block_us
from kvtier.bench.daemon.probes import (
    SIGNATURE,
    SMALL_LOOKUP_HASHES,
    copy_rates,
    hashes_for,
    lookup_worker,
    row_copy_gbps,
    rpc_floor_ms,
    small_lookup_p99_ms,
    store_commit_rates,
)
from kvtier.bench.daemon.proxy import SlowProxy
from kvtier.bench.limits import disk_writing, raw_disk_gbps
from kvtier.bench.redis_server import RedisProcess
from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.proto import contract
from kvtier.service.config import DaemonConfig

AIMS = {
    "lookup_p50_us": 50,
    "store_control_us": 200,
    "slot_op_p99_us": 2000,
    "lookup_p50_ms": 0.5,
    "lookup_p99_ms": 2.0,
    "lookups_per_s": 5000,
    "small_lookup_p99_ms": 5.0,
    "small_lookup_p99_slow_remote_ms": 20.0,
    "store_ratio": 0.8,
    "load_ratio": 0.8,
    "store_commit_ratio": 0.8,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--clients", type=int, default=2, help="paced mix client processes")
    parser.add_argument(
        "--rate", type=float, default=5.0, help="mix requests per second per client"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the mix runs")
    parser.add_argument(
        "--lookup-index",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mix clients probe the lookup index, as the connector's scheduler does",
    )
    parser.add_argument(
        "--lookup-clients", type=int, default=2, help="back-to-back lookup client processes"
    )
    parser.add_argument("--hashes", type=int, default=1000, help="hashes per lookup")
    parser.add_argument("--lookups", type=int, default=3000, help="back-to-back lookups per client")
    parser.add_argument(
        "--small-lookups", type=int, default=2000, help="small lookups timed beside a heavy client"
    )
    parser.add_argument("--block-kib", type=int, default=2048, help="block size in KiB")
    parser.add_argument("--batch", type=int, default=32, help="blocks per store/load batch")
    parser.add_argument("--rounds", type=int, default=8, help="timed store/load batches")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes for a test (overrides the size options)"
    )


QUICK = {
    "hashes": 300,
    "lookups": 50,
    "small_lookups": 50,
    "block_kib": 64,
    "batch": 8,
    "rounds": 2,
    "seconds": 1.0,
}
"""``--quick``'s sizes: every phase runs, a lookup still goes past the event loop's batch."""


SLOW_REMOTE_S = 0.2
"""How late the slow remote store answers each request."""


def start_daemon(
    root: Path, host_bytes: int, disk_bytes: int, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """A ``kvtier serve`` subprocess on private paths under ``root``; returns it and its target."""
    root.mkdir(parents=True, exist_ok=True)
    socket = root / "d.sock"
    cmd = [
        sys.executable,
        "-m",
        "kvtier.service.serve",
        "--name",
        f"bench-{uuid.uuid4().hex[:8]}",
        "--socket",
        str(socket),
        "--data-dir",
        str(root / "data"),
        "--host-bytes",
        str(host_bytes),
        "--disk-bytes",
        str(disk_bytes),
        "--stats-port",
        "-1",
        *extra,
    ]
    with open(root / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return daemon, contract.unix_target(socket)


def connect(target: str, block_bytes: int, root: Path, like_a_worker: bool = False) -> DaemonClient:
    """A client; ``like_a_worker``: one that stores as the connector's worker does (slots
    reserved ahead, the lookup index read for blocks stored already)."""
    client = DaemonClient(
        SIGNATURE,
        block_bytes,
        block_tokens=16,
        target=target,
        timeout_s=30,
        client_name="bench",
        lookup_index=like_a_worker,
        reserve_ahead=like_a_worker,
    )
    if not client.wait_connected(60):
        raise RuntimeError(f"daemon did not come up: {(root / 'daemon.log').read_text()}")
    return client


def lookup_figures(target: str, block_bytes: int, args: argparse.Namespace) -> dict[str, float]:
    """Lookups of ``args.hashes`` held blocks from ``args.lookup_clients`` processes at once."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=lookup_worker, args=(target, block_bytes, args.hashes, args.lookups, out)
        )
        for _ in range(args.lookup_clients)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"lookup clients failed: {failed}")
    for p in procs:
        p.join()
    times = sorted(t for r in results for t in r)
    # per-client busy time, not the wall time, which includes process start-up
    busy = max(sum(r) for r in results)
    return {
        "lookup_p50_ms": statistics.median(times) * 1e3,
        "lookup_p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
        "lookups_per_s": len(times) / busy,
    }


def slow_remote_p99_ms(root: Path, block_bytes: int, lookups: int) -> float | None:
    """A small host-hit lookup's p99 while another client's lookups wait on a remote store
    answering in ``SLOW_REMOTE_S``; None without ``redis-server``."""
    if shutil.which("redis-server") is None:
        return None
    hashes = hashes_for(SMALL_LOOKUP_HASHES)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisProcess())
        # Its lookups are slow; the writes behind the blocks stored here go through at once.
        proxy = stack.enter_context(SlowProxy(server.port, SLOW_REMOTE_S, slow=b"EXISTS"))
        host_bytes = 2 * len(hashes) * block_bytes
        daemon, target = start_daemon(root, host_bytes, 0, ("--remote", proxy.url))
        try:
            client = connect(target, block_bytes, root)
            if not client.commit(client.reserve(hashes)):
                raise RuntimeError("could not store the lookup blocks")
            # The other client's lookups are small too: each misses the host tier and waits
            # on the store, one after another. The small ones go every few milliseconds, as
            # an engine's steps ask, so that every wait of the loop would meet some of them.
            p99 = small_lookup_p99_ms(target, block_bytes, len(hashes), lookups, 0.005)
            stats = client.tools.stats()
            client.close()
            remote = next(t for t in stats.tiers if t.tier == "remote")
            if not remote.query_tokens or remote.other["fault_misses"]:
                raise RuntimeError(f"the remote store was not asked, or not answered: {remote}")
        finally:
            daemon.terminate()
            daemon.wait(30)
    return p99


def run(args: argparse.Namespace) -> int:
    if args.quick:
        vars(args).update(QUICK)
    # One thread per copy, like a copy stream: torch's intra-op pool makes small copies far
    # slower on a busy machine (thread wake-ups, not bandwidth).
    torch.set_num_threads(1)
    block_bytes = args.block_kib << 10
    # room for the stored lookup blocks, the copy rates' batches, the mix's newest stores
    # (older ones are evicted as it stores more) and the slots that each session storing as
    # the connector's worker does (the store-control client, each mix client) reserves ahead:
    # without that room the mix client's first reservation evicted lookup blocks no lookup
    # had touched yet, and with one client its first lookup missed
    ahead = DaemonConfig.reserve_ahead_blocks
    slots = args.hashes + 2 * args.batch * args.rounds + (64 + ahead) * args.clients + ahead
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/tmp"))
    started = time.perf_counter()
    try:
        daemon, target = start_daemon(root / "host-only", slots * block_bytes, 0)
        # the clients are closed however a phase ends: a client left open when the bench
        # fails aborts the interpreter at exit (its channel's threads still running)
        try:
            with connect(target, block_bytes, root / "host-only") as client:
                rates = copy_rates(client, args.batch, args.rounds)
                floor_ms = rpc_floor_ms(target)
                hashes = hashes_for(args.hashes)
                for i in range(0, len(hashes), args.batch):
                    chunk = hashes[i : i + args.batch]
                    if not client.commit(client.reserve(chunk)):
                        raise RuntimeError("could not store the lookup blocks")
                by_hash_us = store_control_us(client, args.batch, args.rounds)
                with connect(target, block_bytes, root / "host-only", like_a_worker=True) as worker:
                    control_us = store_control_us(worker, args.batch, args.rounds, later=True)
                plan = MixPlan(
                    target, block_bytes, args.hashes, args.rate, args.seconds, args.lookup_index
                )
                mix = mix_figures(plan, args.clients)
                lookups = lookup_figures(target, block_bytes, args)
                small_p99 = small_lookup_p99_ms(
                    target, block_bytes, contract.MAX_HASHES, args.small_lookups
                )
        finally:
            daemon.terminate()
            daemon.wait(30)
        slow_remote_p99 = slow_remote_p99_ms(
            root / "slow-remote", block_bytes, min(1000, args.small_lookups)
        )
        burst = 2 * args.batch * args.rounds
        daemon, target = start_daemon(root / "disk", burst * block_bytes, 4 * burst * block_bytes)
        try:
            client = connect(target, block_bytes, root / "disk")
            behind = store_commit_rates(client, args.batch, args.rounds)
            client.close()
        finally:
            daemon.terminate()
            daemon.wait(30)
        raw_write, _, how = raw_disk_gbps(str(root), burst * block_bytes)
        floors = idle_floors(args.hashes)
        per_block = per_block_us(args.batch, max(args.rounds, 50), args.hashes)
        src = torch.randint(0, 256, (burst // 2, block_bytes), dtype=torch.uint8)
        dst = src.clone()
        with disk_writing(str(root)):
            time.sleep(0.1)  # the writes under way
            # the median of several: one short copy may fall between two of the writes
            busy_memcpy = statistics.median(row_copy_gbps(dst, src) for _ in range(7))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {
        "clients": args.clients,
        "rate_per_client": args.rate,
        **mix,
        "store_control_us": control_us,
        "store_control_by_hash_us": by_hash_us,
        **floors,
        **per_block,
        **lookups,
        "rpc_floor_p50_ms": floor_ms,
        "lookup_vs_floor": lookups["lookup_p50_ms"] / floor_ms,
        "small_lookup_p99_ms": small_p99,
        **(
            {"small_lookup_p99_slow_remote_ms": slow_remote_p99}
            if slow_remote_p99 is not None
            else {}
        ),
        **rates,
        "store_ratio": rates["store_gbps"] / rates["memcpy_gbps"],
        "load_ratio": rates["load_gbps"] / rates["memcpy_gbps"],
        **behind,
        "store_commit_ratio": behind["store_commit_gbps"] / rates["memcpy_gbps"],
        "memcpy_disk_busy_gbps": busy_memcpy,
        "store_commit_vs_busy_memcpy": behind["store_commit_gbps"] / busy_memcpy,
        "disk_raw_write_gbps": raw_write,
        "disk_drain_ratio": behind["disk_drain_gbps"] / raw_write,
        "disk_raw_how": how,
        "lookup_clients": args.lookup_clients,
        "hashes_per_lookup": args.hashes,
        "block_bytes": block_bytes,
        "batch_blocks": args.batch,
        "wall_s": time.perf_counter() - started,
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
        note = f"   (aim {'<=' if key.endswith(('_ms', '_us')) else '>='} {aim})" if aim else ""
        if isinstance(value, float):
            print(f"{key:>32}  {value:12.3f}{note}")
        else:
            print(f"{key:>32}  {value!s:>12}")
    return 0
