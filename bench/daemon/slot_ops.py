"""Slot operations over the slot channel, the ``SlotOps`` stream and unary calls, side by side.

``python -m kvtier.bench.daemon.slot_ops [--rounds N] [--threads T] [--json]`` starts a daemon
(host tier only) and three clients of it, one sending slot operations unary, one over its
gRPC stream and one over the daemon's slot channel, and times them in alternating rounds so
that all see the same machine:

* ``{unary,stream,channel}_reserve_commit_p50_us`` / ``_p99_us``: a 4-block Reserve + Commit;
* ``…_acquire_release_p50_us`` / ``_p99_us``: a 4-block Acquire + Release (the Release is
  sent without waiting; the next Acquire waits for its answer first);
* ``…_ops_per_s``: Reserve + Commit + Acquire + Release of 4 blocks from ``--threads`` threads
  of one client at once, operations answered per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from kvtier.bench.daemon.command import start_daemon
from kvtier.bench.daemon.probes import SIGNATURE
from kvtier.connector.client.daemon_client import DaemonClient

BLOCK_BYTES = 64 << 10
BLOCKS = 4
WAYS = ("unary", "stream", "channel")


def _hashes() -> list[bytes]:
    return [uuid.uuid4().bytes for _ in range(BLOCKS)]


def _pair_times(client: DaemonClient, rounds: int) -> tuple[list[float], list[float]]:
    stores, loads = [], []
    for _ in range(rounds):
        hashes = _hashes()
        start = time.perf_counter()
        slots = client.reserve(hashes)
        ok = client.commit(slots)
        stores.append(time.perf_counter() - start)
        start = time.perf_counter()
        slots = client.acquire(hashes)
        client.release(slots)
        loads.append(time.perf_counter() - start)
        if not ok or len(slots) != BLOCKS:
            raise RuntimeError(f"a store or load missed ({client.failures} failures)")
    return stores, loads


def _ops_per_s(client: DaemonClient, threads: int, rounds: int) -> float:
    def work() -> None:
        for _ in range(rounds):
            hashes = _hashes()
            client.commit(client.reserve(hashes))
            client.release(client.acquire(hashes))

    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    client.settle(30)
    return 4 * threads * rounds / (time.perf_counter() - start)


def _quantiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e6, ordered[int(0.99 * (len(ordered) - 1))] * 1e6


def measure(rounds: int, threads: int, root: Path) -> dict[str, float]:
    daemon, target = start_daemon(root, host_bytes=4096 * BLOCK_BYTES, disk_bytes=0)
    clients = {}
    try:
        for name in WAYS:
            clients[name] = DaemonClient(
                SIGNATURE,
                BLOCK_BYTES,
                target=target,
                timeout_s=30,
                slot_stream=name != "unary",
                slot_channel=name == "channel",
            )
            if not clients[name].wait_connected(60):
                raise RuntimeError((root / "daemon.log").read_text())
        times = {name: ([], []) for name in clients}
        per_round = max(1, rounds // 10)
        for client in clients.values():
            _pair_times(client, 20)  # warm each way (a stream opens on its first operation)
        for _ in range(10):
            for name, client in clients.items():
                stores, loads = _pair_times(client, per_round)
                times[name][0].extend(stores)
                times[name][1].extend(loads)
        figures = {}
        for name, (stores, loads) in times.items():
            p50, p99 = _quantiles(stores)
            figures[f"{name}_reserve_commit_p50_us"] = p50
            figures[f"{name}_reserve_commit_p99_us"] = p99
            p50, p99 = _quantiles(loads)
            figures[f"{name}_acquire_release_p50_us"] = p50
            figures[f"{name}_acquire_release_p99_us"] = p99
        for name, client in clients.items():
            figures[f"{name}_ops_per_s"] = _ops_per_s(client, threads, max(1, rounds // threads))
        for name in ("stream", "channel"):
            calls = clients[name].slot_calls
            opened = calls.channels_opened if name == "channel" else calls.streams_opened
            if calls.fallbacks or not calls.streamed or opened != 1:
                raise RuntimeError(f"the {name} client did not use its {name} throughout")
        return figures
    finally:
        for client in clients.values():
            client.close()
        daemon.terminate()
        daemon.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-slot-ops-") as root:
        figures = measure(args.rounds, args.threads, Path(root))
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:36s} {value:10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
