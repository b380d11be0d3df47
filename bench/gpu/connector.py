"""The vLLM connector's copy path on a CUDA device, for ``kvtier bench gpu``.

Everything is what a vLLM worker runs: per-layer views over one flat KV buffer laid out as
vLLM lays out ``BLHNC`` (and ``LBHNC``, which goes through the staging ring), the placement
``connector.vllm_layout.kv_placement`` reads from them, the daemon's shared-memory arena
(``service.arena.Arena``) mapped on a helper thread by ``ArenaView`` as the client maps it and
page-locked by the copy engine on this thread, scattered block ids into scattered slots, and
a compute stream kept busy with matmuls while the copies run. Rates come from each
transfer's own CUDA events; the engine thread's time inside kvtier calls is wall time.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvtier.connector.client.arena import ArenaView
from kvtier.connector.vllm.layout import kv_placement
from kvtier.service.arena import Arena
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.gpu.transfer import Transfer
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.tunables import TUNABLES


@dataclass(frozen=True, slots=True)
class ConnectorRates:
    order: str
    d2h_gbps: float
    h2d_gbps: float
    bidir_gbps: float
    staging_bytes: int
    """Peak GPU bytes kvtier allocated (its ring, if any) while copying."""
    round_trip_exact: bool
    host_pinned: bool


@dataclass(frozen=True, slots=True)
class StepCost:
    sync_ms: float
    """Mean wall time per step of the engine thread inside kvtier calls."""
    step_ms_off: float
    step_ms_on: float

    @property
    def overhead(self) -> float:
        return self.step_ms_on / self.step_ms_off - 1.0


class Matmuls:
    """A compute stream kept busy: bf16 matmuls queued for a given number of milliseconds."""

    def __init__(self, size: int = 4096):
        self.a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.queue_n(4)
        start.record()
        self.queue_n(20)
        end.record()
        end.synchronize()
        self.ms_each = start.elapsed_time(end) / 20

    def queue_n(self, n: int) -> None:
        for _ in range(n):
            torch.matmul(self.a, self.b, out=self.out)

    def queue(self, ms: float) -> None:
        self.queue_n(max(1, round(ms / self.ms_each)))


@contextlib.contextmanager
def daemon_arena(num_slots: int, block_bytes: int) -> Iterator[torch.Tensor]:
    """The daemon's arena file, mapped as the client maps it (on a helper thread).

    In ``/dev/shm`` as the daemon makes it, never in a disk directory: recent Linux kernels
    refuse to page-lock a writable shared mapping of a disk file, so it would measure
    synchronous copies. Where ``/dev/shm`` is too small, ``ArenaError`` says how to fix it.
    """
    arena = Arena(f"kvtier-bench-{os.getpid()}", num_slots * block_bytes)
    view = ArenaView(block_bytes)
    mapper = threading.Thread(
        target=view.map, args=(str(arena.path), arena.size, num_slots), name="kvtier-client"
    )
    mapper.start()
    mapper.join()
    try:
        yield view.slab
    finally:
        view.unmap()
        arena.close()


def vllm_placement(
    layout: KVLayout, num_blocks: int, order: str, device: str = "cuda"
) -> KVPlacement:
    """Random KV in vLLM's ``order``, seen through the worker's own ``tiers.gpu.placement``."""
    made = KVPlacement.allocate(layout, num_blocks, device, order)
    gen = torch.Generator(device=device).manual_seed(0)
    made.buffer.copy_(
        torch.randint(0, 256, made.buffer.shape, dtype=torch.uint8, device=device, generator=gen)
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers)]
    return kv_placement(layout, dict(zip(names, made.layer_views(), strict=True)), names)


def _span_s(*transfers: Transfer) -> float:
    """Seconds from the earliest first byte to the latest last byte of ``transfers``."""
    first = transfers[0].start_event
    for t in transfers[1:]:
        if first.elapsed_time(t.start_event) < 0:
            first = t.start_event
    return max(first.elapsed_time(t.done_event) for t in transfers) / 1000


def connector_rates(
    layout: KVLayout,
    order: str,
    num_blocks: int,
    batch: int,
    iters: int,
    pcie_gbps: float,
    staging_bytes: int = TUNABLES.staging_bytes,
) -> ConnectorRates:
    """Best-of-``iters`` GB/s of ``batch``-block stores, loads and both at once."""
    if num_blocks < 3 * batch:
        raise ValueError(f"{num_blocks} KV blocks cannot hold three batches of {batch}")
    gen = torch.Generator().manual_seed(1)
    mm = Matmuls()
    placement = vllm_placement(layout, num_blocks, order)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with daemon_arena(2 * batch, layout.block_bytes) as slab:
        engine = CopyEngine(placement, slab, staging_bytes=staging_bytes)
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        out_slots = torch.randperm(batch, generator=gen).tolist()
        in_slots = [batch + s for s in torch.randperm(batch, generator=gen).tolist()]
        copy_ms = batch * layout.block_bytes / pcie_gbps / 1e6
        d2h = h2d = bidir = 0.0
        gb = batch * layout.block_bytes / 1e9
        for _ in range(iters):
            mm.queue(2.0)  # the store waits for this, then overlaps what follows
            store = engine.store(ids[:batch], out_slots)
            mm.queue(2 * copy_ms)
            store.wait()
            d2h = max(d2h, gb / store.elapsed_s())
            mm.queue(2.0)
            load = engine.load(out_slots, ids[batch : 2 * batch])
            mm.queue(2 * copy_ms)
            load.wait()
            h2d = max(h2d, gb / load.elapsed_s())
            mm.queue(2.0)
            both = (engine.store(ids[:batch], in_slots), engine.load(out_slots, ids[-batch:]))
            mm.queue(4 * copy_ms)
            engine.synchronize()
            bidir = max(bidir, 2 * gb / _span_s(*both))
        engine.poll()
        staging = torch.cuda.max_memory_allocated() - base
        back = torch.empty((batch, layout.block_bytes), dtype=torch.uint8, device="cuda")
        want = torch.empty_like(back)
        placement.gather(torch.tensor(ids[-batch:], device="cuda"), back)
        placement.gather(torch.tensor(ids[:batch], device="cuda"), want)
        exact = torch.equal(back, want)
        pinned = engine.host_pinned
        engine.close()
    return ConnectorRates(order, d2h, h2d, bidir, staging, exact, pinned)


def step_cost(
    layout: KVLayout, num_blocks: int, blocks_per_step: int, steps: int, step_ms: float
) -> StepCost:
    """A serving loop with zero reuse: each step computes for ``step_ms``, then waits for its
    result (the sampler's copy); with kvtier on, the previous step's new blocks are stored at
    the step's start (deferred, as the worker does) and finished copies are polled."""
    mm = Matmuls()
    placement = vllm_placement(layout, num_blocks, "BLHNC")
    gen = torch.Generator().manual_seed(2)
    with daemon_arena(blocks_per_step * steps, layout.block_bytes) as slab:
        engine = CopyEngine(placement, slab)
        picks = torch.randperm(num_blocks, generator=gen).tolist()

        def run(kvtier: bool) -> tuple[float, float]:
            inside = 0.0
            torch.cuda.synchronize()
            started = time.perf_counter()
            for step in range(steps):
                if kvtier and step:
                    t0 = time.perf_counter()
                    first = (step - 1) * blocks_per_step % (num_blocks - blocks_per_step)
                    ids = picks[first : first + blocks_per_step]
                    slots = range((step - 1) * blocks_per_step, step * blocks_per_step)
                    engine.store(ids, list(slots))
                    engine.poll()
                    inside += time.perf_counter() - t0
                mm.queue(step_ms)
                torch.cuda.current_stream().synchronize()  # the step's sampled tokens
            engine.synchronize()
            wall = (time.perf_counter() - started) * 1000 / steps
            return wall, inside * 1000 / max(steps - 1, 1)

        run(False)  # warm-up
        off, _ = run(False)
        on, inside = run(True)
        engine.close()
    return StepCost(inside, off, on)
