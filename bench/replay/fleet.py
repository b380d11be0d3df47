"""``kvtier bench replay --nodes N``: a fleet of serving nodes that share one remote tier.

A router spreads the requests over N nodes: round-robin, or uniformly at random (seeded). Each
node runs as the daemon does when the vLLM connector feeds it (``Node`` with
``store_on_compute``), over tiers of its own: a GPU pool, a host tier and a disk tier in its own
directory, each of the given capacity. Below them every node has the real remote tier
(``RemoteTier``: kvtier's Redis backend, key format, checksummed values, write-behind queue),
with its own connections to one store that all nodes share: a private ``redis-server`` the
replay starts on localhost. So the remote tier is what the other tiers of the replay are too,
kvtier's own code in this process over a real medium, not a model of one. The store is sized
so that its LRU evicts nothing: a remote miss is a block no node has written.

The same requests on the same routes run three times: with the shared remote tier, on the same
nodes without it, and on the same GPU pools alone.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields

from kvtier.bench.redis_server import RedisProcess
from kvtier.bench.replay.sim import (
    REPLAY_LAYOUT,
    Capacity,
    Node,
    RunResult,
    Workload,
    build_replay_stack,
    run_nodes,
)
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.host.admission import DEFAULT_POLICY
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.format import value_size
from kvtier.tiers.remote.tier import RemoteSettings

ROUTERS = ("round-robin", "random")
REMOTE_SETTINGS = RemoteSettings(lookup_timeout_s=30.0, transfer_timeout_s=60.0)
"""The replay counts reuse, not latency: waits long enough that a busy machine never turns a
hit into a fault miss (the JSON reports ``remote_fault_misses`` all the same)."""


@dataclass(slots=True)
class FleetResult:
    """The three runs of one fleet, and its remote tiers' counters summed over the nodes."""

    nodes: int
    router: str
    shared: RunResult
    no_remote: RunResult
    gpu_only: RunResult
    remote: TierCounters
    node_requests: list[int]


def route(count: int, nodes: int, router: str, seed: int = 0) -> list[int]:
    """The node of each of ``count`` requests, in arrival order."""
    if nodes < 1:
        raise ValueError(f"a fleet needs at least one node, got {nodes}")
    if router == "round-robin":
        return [i % nodes for i in range(count)]
    if router == "random":
        rng = random.Random(seed)
        return [rng.randrange(nodes) for _ in range(count)]
    raise ValueError(f"unknown router {router!r}; use one of {ROUTERS}")


def store_bytes(distinct_blocks: int) -> int:
    """``maxmemory`` for the shared store: every distinct block twice over (room for Redis's
    per-key overhead) and 64 MiB, so its LRU never evicts during a replay."""
    block = value_size(REPLAY_LAYOUT.block_bytes, 0)  # the replay's blocks carry no meta
    return 2 * distinct_blocks * block + (64 << 20)


def run_fleet(
    work: Workload,
    capacity: Capacity,
    nodes: int,
    routes: Sequence[int],
    *,
    store_url: str | None,
    ms_per_output_token: float,
    label: str,
    admission: str = DEFAULT_POLICY,
) -> tuple[RunResult, list[RunResult], TierCounters]:
    """One run of the fleet: (its counts, each node's, its remote tiers' counters summed).

    Each node gets a remote tier on ``store_url`` when given and the capacity has a host tier
    (the remote tier sits below it), and the ``admission`` policy on its host tier; all of its
    tiers are closed before this returns.
    """
    remote_counters: list[TierCounters] = []
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-replay-"))
        fleet: list[Node] = []
        for i in range(nodes):
            remote = None
            if store_url is not None and capacity.host_bytes > 0:
                config = RemoteConfig(store_url, settings=REMOTE_SETTINGS)
                remote = config.open_tier(REPLAY_LAYOUT.signature, REPLAY_LAYOUT.block_bytes)
                stack.callback(remote.close)
                remote_counters.append(remote.counters)
            disk_dir = os.path.join(tmp, f"node{i}") if capacity.disk_bytes > 0 else None
            tiers = build_replay_stack(
                capacity, disk_dir, remote=remote, write_behind=True, admission=admission
            )
            # Nothing needs to outlive the run: no spill of every cached block at the end.
            stack.callback(tiers.close, persist=False)
            fleet.append(Node(tiers, remote=remote, store_on_compute=True))
        total = run_nodes(fleet, work.requests, work.hashes, routes, ms_per_output_token, label)
    return total, [node.result for node in fleet], _sum_counters(remote_counters)


def replay_fleet(
    work: Workload,
    capacity: Capacity,
    nodes: int,
    router: str,
    *,
    seed: int = 0,
    ms_per_output_token: float = 20.0,
    admission: str = DEFAULT_POLICY,
) -> FleetResult:
    """The fleet with its shared remote tier (on a private ``redis-server``), the same nodes
    without it, and GPU pools alone, all on the same routes, each host tier under the
    ``admission`` policy."""
    routes = route(len(work.requests), nodes, router, seed)
    ms, policy = ms_per_output_token, admission
    with RedisProcess(maxmemory=store_bytes(work.distinct_blocks)) as server:
        shared, per_node, remote = run_fleet(
            work,
            capacity,
            nodes,
            routes,
            store_url=server.url,
            ms_per_output_token=ms,
            label="shared",
            admission=policy,
        )
    no_remote, _, _ = run_fleet(
        work,
        capacity,
        nodes,
        routes,
        store_url=None,
        ms_per_output_token=ms,
        label="no-remote",
        admission=policy,
    )
    gpu_only, _, _ = run_fleet(
        work,
        Capacity(capacity.gpu_blocks),
        nodes,
        routes,
        store_url=None,
        ms_per_output_token=ms,
        label="gpu-only",
    )
    node_requests = [r.requests for r in per_node]
    return FleetResult(nodes, router, shared, no_remote, gpu_only, remote, node_requests)


def _sum_counters(parts: Sequence[TierCounters]) -> TierCounters:
    out = TierCounters("remote")
    for f in fields(TierCounters):
        if f.name != "tier":
            setattr(out, f.name, sum(getattr(p, f.name) for p in parts))
    return out


def fleet_summary(fleet: FleetResult) -> dict[str, object]:
    """The keys a fleet adds to the replay's JSON; its capacities are each node's."""
    shared, no_remote, remote = fleet.shared, fleet.no_remote, fleet.remote
    return {
        "nodes": fleet.nodes,
        "router": fleet.router,
        "node_requests": fleet.node_requests,
        "remote_hit_tokens": shared.remote_hit_tokens,
        "no_remote_saved_tokens": no_remote.saved_tokens,
        "saved_vs_no_remote": (
            shared.saved_tokens / no_remote.saved_tokens if no_remote.saved_tokens else None
        ),
        "no_remote_hit_tokens": {
            "gpu": no_remote.gpu_hit_tokens,
            "host": no_remote.host_hit_tokens,
            "disk": no_remote.disk_hit_tokens,
        },
        "remote_blocks_stored": remote.blocks_stored,
        "remote_blocks_deduplicated": remote.blocks_deduplicated,
        "remote_blocks_dropped": remote.blocks_dropped,
        "remote_fault_misses": remote.fault_misses,
        "remote_checksum_failures": remote.checksum_failures,
        "no_remote_corrupt_blocks": no_remote.corrupt_blocks,
        "no_remote_wall_s": round(no_remote.wall_s, 3),
    }


def fleet_lines(s: dict[str, object]) -> list[str]:
    """The text lines a fleet adds to the replay's report."""
    ratio = s["saved_vs_no_remote"]
    return [
        f"{s['nodes']} nodes, {s['router']} router, requests per node {s['node_requests']}; "
        "the capacity below is each node's; all share one remote tier (private redis-server)",
        f"prefill saved without the remote tier: {s['no_remote_saved_tokens']} tokens; with it "
        f"{'n/a' if ratio is None else f'{ratio:.3f}'}x that",
        f"remote tier: {s['remote_blocks_stored']} blocks stored, "
        f"{s['remote_blocks_deduplicated']} already held, {s['remote_blocks_dropped']} dropped, "
        f"{s['remote_fault_misses']} fault misses, {s['remote_checksum_failures']} checksum "
        "failures",
    ]
