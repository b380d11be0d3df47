"""Replays requests through real tier stacks and counts, in tokens, the prefill they save.

Each request arrives at its timestamp on one node (a fleet of one unless ``fleet`` builds
several) and runs once that node's GPU pool has room for its whole sequence (prompt and output),
first come first served. It takes its cached prefix through the fall-through walk
(which copies lower-tier hits into GPU blocks for real), "computes" the rest by writing each
block's bytes (derived from its hash, so every load is checked against what was stored), names
its full prompt blocks at once as an engine does after prefill, and holds all its blocks for
``output_length`` decode steps of ``ms_per_output_token`` each. Then it frees them tail first.
Recycled blocks spill to the host tier, whose evictions spill to disk, exactly as in an engine;
the GPU-only baseline runs the same pool with no tiers below it. A node run as a daemon
(``store_on_compute``, as the vLLM connector feeds the daemon) instead hands each newly computed
block to its host tier right after prefill, and the host tier writes it behind to the disk and
remote tiers.
"""

from __future__ import annotations

import heapq
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from tqdm import tqdm

from kvtier.bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.free_queue import KVBlock
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host.admission import DEFAULT_POLICY, admission_policy
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.stack import TierStack, build_stack

REPLAY_LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_size=1, block_size=TRACE_BLOCK_TOKENS, dtype=torch.uint8
)
"""1 KiB blocks of 512 tokens: the trace's block size with real bytes, small enough for RAM."""


@dataclass(slots=True)
class Workload:
    """The requests of one replay and the block hashes of their prompts."""

    name: str
    requests: list[TraceRequest]
    hashes: list[list[BlockHash]]
    distinct_blocks: int
    hash_wall_s: float


@dataclass(frozen=True, slots=True)
class Capacity:
    """Tier sizes of one node; ``host_bytes == 0`` means GPU only (no lower tiers)."""

    gpu_blocks: int
    host_bytes: int = 0
    disk_bytes: int = 0


@dataclass(slots=True)
class RunResult:
    """Token counts of one replay (of one node, or summed over a fleet); hits are prompt
    tokens whose KV some tier supplied."""

    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    skipped_requests: int = 0
    max_running: int = 0
    blocks_spilled_to_host: int = 0
    blocks_spilled_to_disk: int = 0
    blocks_not_admitted: int = 0
    """Blocks the host tier's admission policy turned away."""
    blocks_kept_off_disk: int = 0
    """Blocks evicted from the host tier that its admission policy kept off the disk."""
    disk_bytes_written: int = 0
    """Block bytes the disk tier wrote (spills, writes behind, remote hits landing there)."""
    corrupt_blocks: int = 0
    wall_s: float = 0.0

    @property
    def saved_tokens(self) -> int:
        hits = (self.gpu_hit_tokens, self.host_hit_tokens, self.disk_hit_tokens)
        return sum(hits) + self.remote_hit_tokens

    @property
    def bytes_written_per_saved_token(self) -> float | None:
        """What the disk's endurance paid for each prefill token saved (by any tier)."""
        return self.disk_bytes_written / self.saved_tokens if self.saved_tokens else None

    @classmethod
    def total(cls, parts: Sequence[RunResult], wall_s: float) -> RunResult:
        """The fleet's result: counts summed, ``max_running`` the busiest node's."""
        out = cls(wall_s=wall_s)
        for f in fields(cls):
            if f.name in ("max_running", "wall_s"):
                continue
            setattr(out, f.name, sum(getattr(p, f.name) for p in parts))
        out.max_running = max((p.max_running for p in parts), default=0)
        return out


@dataclass(order=True, slots=True)
class _Running:
    finish_ms: float
    seq_no: int
    blocks: list[KVBlock] = field(compare=False)


def block_patterns(hashes: Sequence[BlockHash], layout: KVLayout) -> torch.Tensor:
    """Each block's bytes, its hash repeated: uint8 ``[n, block_bytes]`` canonical blocks."""
    reps = layout.block_bytes // len(hashes[0])
    raw = bytearray(b"".join(h * reps for h in hashes))
    return torch.frombuffer(raw, dtype=torch.uint8).view(len(hashes), layout.block_bytes)


def oracle_saved_tokens(requests: Sequence[TraceRequest], hashes: Sequence[list[BlockHash]]) -> int:
    """Saved tokens with an unbounded cache: every full prompt block ever computed stays."""
    seen: set[BlockHash] = set()
    saved = 0
    for request, hs in zip(requests, hashes, strict=True):
        claimable = min(len(hs), (request.input_length - 1) // TRACE_BLOCK_TOKENS)
        n = 0
        while n < claimable and hs[n] in seen:
            n += 1
        saved += n * TRACE_BLOCK_TOKENS
        seen.update(hs)
    return saved


def build_replay_stack(
    capacity: Capacity,
    disk_dir: str | None,
    *,
    remote: RemoteTier | None = None,
    write_behind: bool = False,
    admission: str = DEFAULT_POLICY,
) -> TierStack:
    """The stack under test: GPU pool, then host and disk tiers when the capacity has them,
    and ``remote`` below them. With ``write_behind`` the host tier writes each commit to the
    tiers below at once, as in the daemon; otherwise blocks go down only when evicted.
    ``admission`` names the host tier's admission policy."""
    layout = REPLAY_LAYOUT
    if capacity.host_bytes <= 0:
        return build_stack(layout, capacity.gpu_blocks)
    disk = None
    if capacity.disk_bytes > 0:
        # No fsync per commit: a replay needs no crash safety, only the real write path.
        disk = DiskTier(
            disk_dir, layout.signature, layout.block_bytes, capacity.disk_bytes, sync=False
        )
    host = HostTier(
        layout.block_bytes,
        capacity.host_bytes,
        lower=disk,
        remote=remote,
        write_behind=write_behind,
        admission=admission_policy(admission, capacity.host_bytes // layout.block_bytes),
    )
    return build_stack(layout, capacity.gpu_blocks, lower=host, disk=disk)


def replay(
    requests: Sequence[TraceRequest],
    hashes: Sequence[list[BlockHash]],
    capacity: Capacity,
    *,
    ms_per_output_token: float = 20.0,
    label: str = "replay",
    admission: str = DEFAULT_POLICY,
    as_daemon: bool = False,
) -> RunResult:
    """Runs every request through a fresh stack of ``capacity`` (its host tier under the
    ``admission`` policy) and returns its counts. ``as_daemon`` feeds the node as the vLLM
    connector feeds the daemon (``Node``'s ``store_on_compute``, the host tier writing
    behind) instead of as an engine's own stack."""
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        disk_dir = tmp if capacity.disk_bytes > 0 else None
        stack = build_replay_stack(capacity, disk_dir, write_behind=as_daemon, admission=admission)
        try:
            node = Node(stack, store_on_compute=as_daemon)
            run_nodes([node], requests, hashes, [0] * len(requests), ms_per_output_token, label)
            return node.result
        finally:
            stack.close()


class Node:
    """One serving node of a replay: its tier stack, the requests it runs and its counts.

    With ``store_on_compute`` the node runs as the daemon does, fed by the vLLM connector: each
    request's newly computed full blocks go to the host tier right after its prefill, and the
    host tier's writes behind (to disk, and to ``remote`` if given) finish before the next
    request arrives. In simulated time requests are milliseconds apart and such a write takes
    far less; waiting for it in wall time keeps the counts the same from run to run. Without
    ``store_on_compute`` a block reaches the host tier only when the GPU pool recycles it (an
    engine's own stack).
    """

    def __init__(
        self,
        stack: TierStack,
        *,
        remote: RemoteTier | None = None,
        store_on_compute: bool = False,
    ) -> None:
        self.stack = stack
        self.remote = remote
        self.store_on_compute = store_on_compute
        self.result = RunResult()
        self._running: list[_Running] = []

    def admit(
        self, seq_no: int, request: TraceRequest, hs: list[BlockHash], ms_per_output_token: float
    ) -> None:
        """Runs ``request`` on this node: waits for room, claims its cached prefix, checks
        every loaded block byte for byte, computes and names the rest."""
        stack, result = self.stack, self.result
        pool, cache, layout, kv = stack.pool, stack.cache, stack.layout, stack.placement
        bs = layout.block_size
        result.requests += 1
        now = request.timestamp_ms
        while self._running and self._running[0].finish_ms <= now:
            self._finish_one()
        need = -(-(request.input_length + request.output_length) // bs)
        if need > len(pool.blocks):
            result.skipped_requests += 1
            return
        while pool.num_free < need:
            now = max(now, self._finish_one())
        result.prompt_tokens += request.input_length
        fetched = self._remote_loaded()
        claimed = cache.claim(cache.match(hs, request.input_length))
        # The walk counts a remote hit as a disk hit (both are promoted through the host
        # tier); every block fetched from the remote tier during the claim is one of them.
        remote = self._remote_loaded() - fetched
        claimed.wait()
        loaded = claimed.blocks[claimed.gpu_hits :]
        if loaded:
            ids = torch.tensor([b.block_id for b in loaded])
            want = block_patterns(hs[claimed.gpu_hits : len(claimed.blocks)], layout)
            got = torch.empty_like(want)
            kv.gather(ids, got)
            result.corrupt_blocks += int((got != want).flatten(1).any(1).sum())
        result.gpu_hit_tokens += claimed.gpu_hits * bs
        result.host_hit_tokens += claimed.host_hits * bs
        result.disk_hit_tokens += (claimed.disk_hits - remote) * bs
        result.remote_hit_tokens += remote * bs
        blocks = claimed.blocks + pool.get_new_blocks(need - len(claimed.blocks))
        computed = range(len(claimed.blocks), len(hs))
        if computed:
            ids = torch.tensor([blocks[i].block_id for i in computed])
            kv.scatter(block_patterns(hs[computed.start :], layout), ids)
        pool.cache_full_blocks(blocks[: len(hs)], hs)
        if self.store_on_compute and pool.spiller is not None:
            fresh = [blocks[i] for i in computed if blocks[i].block_hash is not None]
            fresh = [b for b in fresh if not b.below]
            if fresh:
                pool.spiller.spill(fresh)
        self._finish_writes()
        finish = now + request.output_length * ms_per_output_token
        heapq.heappush(self._running, _Running(finish, seq_no, blocks))
        result.max_running = max(result.max_running, len(self._running))

    def drain(self) -> None:
        """Finishes every running request and waits for copies in flight; takes the spill
        and write counts."""
        while self._running:
            self._finish_one()
        self._finish_writes()
        stack, result = self.stack, self.result
        if stack.engine is not None:
            stack.engine.synchronize()
        result.blocks_spilled_to_host = stack.pool.counters.blocks_spilled
        if stack.lower is not None:
            host = stack.lower.counters
            result.blocks_spilled_to_disk = host.blocks_spilled
            result.blocks_not_admitted = host.blocks_not_admitted
            result.blocks_kept_off_disk = host.blocks_kept_off_disk
        if stack.disk is not None:
            stack.disk.flush()
            result.disk_bytes_written = stack.disk.counters.bytes_in

    def _remote_loaded(self) -> int:
        return self.remote.counters.blocks_loaded if self.remote is not None else 0

    def _finish_writes(self) -> None:
        """Waits until the host tier's writes behind are done (its slots unpinned again);
        a host tier that does not write behind has none."""
        host = self.stack.lower
        if host is None or not host.writing_behind:
            return
        if self.stack.disk is not None:
            self.stack.disk.flush()
        if self.remote is not None:
            self.remote.flush()

    def _finish_one(self) -> float:
        done = heapq.heappop(self._running)
        self.stack.pool.free_blocks(reversed(done.blocks))
        return done.finish_ms


def run_nodes(
    nodes: Sequence[Node],
    requests: Sequence[TraceRequest],
    hashes: Sequence[list[BlockHash]],
    routes: Sequence[int],
    ms_per_output_token: float,
    label: str,
) -> RunResult:
    """Sends request ``i`` to ``nodes[routes[i]]``, in arrival order; returns the fleet's
    counts (each node's are in its ``result``)."""
    started = time.perf_counter()
    work = list(zip(requests, hashes, routes, strict=True))
    for seq_no, (request, hs, route) in enumerate(
        tqdm(work, desc=label, file=sys.stderr, unit="req")
    ):
        nodes[route].admit(seq_no, request, hs, ms_per_output_token)
    for node in nodes:
        node.drain()
    wall_s = time.perf_counter() - started
    for node in nodes:
        node.result.wall_s = wall_s
    return RunResult.total([node.result for node in nodes], wall_s)
