"""Replays requests through a real tier stack and counts, in tokens, the prefill it saves.

Each request arrives at its timestamp and runs once the GPU pool has room for its whole
sequence (prompt and output), first come first served. It takes its cached prefix through the
fall-through walk (which copies lower-tier hits into GPU blocks for real), "computes" the rest
by writing each block's bytes (derived from its hash, so every load is checked against what was
stored), names its full prompt blocks at once as an engine does after prefill, and holds all its
blocks for ``output_length`` decode steps of ``ms_per_output_token`` each. Then it frees them
tail first. Recycled blocks spill to the host tier, whose evictions spill to disk, exactly as
in an engine; the GPU-only baseline runs the same pool with no tiers below it.
"""

from __future__ import annotations

import heapq
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvtier.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.free_queue import KVBlock
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host import HostTier
from kvtier.tiers.layout import KVLayout
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
    """Tier sizes of one run; ``host_bytes == 0`` means GPU only (no lower tiers)."""

    gpu_blocks: int
    host_bytes: int = 0
    disk_bytes: int = 0


@dataclass(slots=True)
class RunResult:
    """Token counts of one replay; hits are prompt tokens whose KV some tier supplied."""

    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    skipped_requests: int = 0
    max_running: int = 0
    blocks_spilled_to_host: int = 0
    blocks_spilled_to_disk: int = 0
    corrupt_blocks: int = 0
    wall_s: float = 0.0

    @property
    def saved_tokens(self) -> int:
        return self.gpu_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens


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


def build_replay_stack(capacity: Capacity, disk_dir: str | None) -> TierStack:
    """The stack under test: GPU pool, then host and disk tiers when the capacity has them."""
    layout = REPLAY_LAYOUT
    if capacity.host_bytes <= 0:
        return build_stack(layout, capacity.gpu_blocks)
    disk = None
    if capacity.disk_bytes > 0:
        # No fsync per commit: a replay needs no crash safety, only the real write path.
        disk = DiskTier(
            disk_dir, layout.signature, layout.block_bytes, capacity.disk_bytes, sync=False
        )
    host = HostTier(layout.block_bytes, capacity.host_bytes, lower=disk)
    return build_stack(layout, capacity.gpu_blocks, lower=host, disk=disk)


def replay(
    requests: Sequence[TraceRequest],
    hashes: Sequence[list[BlockHash]],
    capacity: Capacity,
    *,
    ms_per_output_token: float = 20.0,
    label: str = "replay",
) -> RunResult:
    """Runs every request through a fresh stack of ``capacity`` and returns its counts."""
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        stack = build_replay_stack(capacity, tmp if capacity.disk_bytes > 0 else None)
        try:
            return _run(stack, requests, hashes, ms_per_output_token, label)
        finally:
            stack.close()


def _run(
    stack: TierStack,
    requests: Sequence[TraceRequest],
    hashes: Sequence[list[BlockHash]],
    ms_per_output_token: float,
    label: str,
) -> RunResult:
    pool, cache, layout = stack.pool, stack.cache, stack.layout
    kv = stack.placement
    bs = layout.block_size
    result = RunResult(requests=len(requests))
    running: list[_Running] = []
    started = time.perf_counter()

    def finish_one() -> float:
        done = heapq.heappop(running)
        pool.free_blocks(reversed(done.blocks))
        return done.finish_ms

    for seq_no, (request, hs) in enumerate(
        tqdm(list(zip(requests, hashes, strict=True)), desc=label, file=sys.stderr, unit="req")
    ):
        now = request.timestamp_ms
        while running and running[0].finish_ms <= now:
            finish_one()
        need = -(-(request.input_length + request.output_length) // bs)
        if need > len(pool.blocks):
            result.skipped_requests += 1
            continue
        while pool.num_free < need:
            now = max(now, finish_one())
        result.prompt_tokens += request.input_length
        claimed = cache.claim(cache.match(hs, request.input_length))
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
        result.disk_hit_tokens += claimed.disk_hits * bs
        blocks = claimed.blocks + pool.get_new_blocks(need - len(claimed.blocks))
        computed = range(len(claimed.blocks), len(hs))
        if computed:
            ids = torch.tensor([blocks[i].block_id for i in computed])
            kv.scatter(block_patterns(hs[computed.start :], layout), ids)
        pool.cache_full_blocks(blocks[: len(hs)], hs)
        finish = now + request.output_length * ms_per_output_token
        heapq.heappush(running, _Running(finish, seq_no, blocks))
        result.max_running = max(result.max_running, len(running))
    while running:
        finish_one()
    if stack.engine is not None:
        stack.engine.synchronize()
    result.blocks_spilled_to_host = pool.counters.blocks_spilled
    if stack.lower is not None:
        result.blocks_spilled_to_disk = stack.lower.counters.blocks_spilled
    result.wall_s = time.perf_counter() - started
    return result
