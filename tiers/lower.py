"""What the GPU side needs from the tiers below it, in process or behind the daemon.

``HostTier`` (with its ``DiskTier``) satisfies this in process; the daemon's client in
``kvtier.connector`` satisfies it over gRPC and shared memory, so the pool's spills and the
fall-through walk run unchanged either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host import ALREADY_STORED, NO_SPACE, LowerHits

__all__ = ["ALREADY_STORED", "NO_SPACE", "LowerHits", "LowerTier"]


class LowerTier(Protocol):
    """Batched two-phase access to the host tier and, through it, the disk tier."""

    slab: torch.Tensor
    """uint8 ``[num_slots, block_bytes]``: the host slots the copy engine reads and writes."""

    counters: TierCounters

    def lookup(self, hashes: Sequence[BlockHash]) -> LowerHits: ...

    def reserve(self, hashes: Sequence[BlockHash]) -> list[int]: ...

    def commit(self, slots: Sequence[int]) -> None: ...

    def abort(self, slots: Sequence[int]) -> None: ...

    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]: ...

    def release(self, slots: Sequence[int]) -> None: ...
