"""Assembles the in-process tier stack: KV tensors, GPU pool, host tier, disk tier, walk."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.host.admission import DEFAULT_POLICY, admission_policy
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.lower import LowerTier
from kvtier.tiers.pool import BlockSpiller, GpuBlockPool
from kvtier.tiers.walk import PrefixCache


@dataclass
class TierStack:
    """Every part of one engine's cache; ``close()`` persists what it can and closes."""

    layout: KVLayout
    placement: KVPlacement
    pool: GpuBlockPool
    cache: PrefixCache
    lower: LowerTier | None = None
    engine: CopyEngine | None = None
    disk: DiskTier | None = None

    def close(self, persist: bool = True) -> None:
        """Waits for copies in flight, unlocks the host slab, then closes the disk tier.

        With ``persist`` (and a disk tier in this process), every cached GPU block and every
        host block first goes down to the disk, so a restart finds all of them.
        """
        if self.engine is not None:
            if persist and self.disk is not None:
                self.pool.spill_cached()
            self.engine.close()
        if self.disk is not None:
            if persist:
                self.lower.spill_all()
            self.disk.close()


def build_stack(
    layout: KVLayout,
    num_gpu_blocks: int,
    *,
    lower: LowerTier | None = None,
    disk: DiskTier | None = None,
    device: torch.device | str = "cpu",
    spill_ahead: int = 4,
) -> TierStack:
    """A GPU pool on ``device`` over a fresh KV buffer in the canonical block order (every
    block one contiguous run), spilling into ``lower`` if given."""
    placement = KVPlacement.allocate(layout, num_gpu_blocks, device)
    if lower is None:
        pool = GpuBlockPool(num_gpu_blocks)
        return TierStack(layout, placement, pool, PrefixCache(pool, layout.block_size))
    pool = GpuBlockPool(num_gpu_blocks, spill_ahead=spill_ahead)
    engine = CopyEngine(placement, lower.slab, counters=pool.counters)
    pool.spiller = BlockSpiller(lower, engine, pool.counters)
    cache = PrefixCache(
        pool,
        layout.block_size,
        lower=lower,
        engine=engine,
        disk_counters=disk.counters if disk is not None else None,
    )
    return TierStack(layout, placement, pool, cache, lower, engine, disk)


def build_local_stack(
    layout: KVLayout,
    num_gpu_blocks: int,
    *,
    host_bytes: int,
    disk_path: str | os.PathLike | None = None,
    disk_bytes: int = 0,
    device: torch.device | str = "cpu",
    spill_ahead: int = 4,
    admission: str = DEFAULT_POLICY,
) -> TierStack:
    """GPU pool → pinned host tier → LMDB disk tier (when ``disk_path``), all in this process;
    ``admission`` names the host tier's admission policy."""
    disk = None
    if disk_path is not None:
        disk = DiskTier(disk_path, layout.signature, layout.block_bytes, disk_bytes)
    policy = admission_policy(admission, host_bytes // layout.block_bytes)
    host = HostTier(layout.block_bytes, host_bytes, lower=disk, admission=policy)
    return build_stack(
        layout, num_gpu_blocks, lower=host, disk=disk, device=device, spill_ahead=spill_ahead
    )
