"""What the tiers promise each other: the GPU side's view of the lower tiers, and the host
tier's view of the disk and remote tiers below it.

``HostTier`` (with its disk and remote tiers) satisfies ``LowerTier`` in process; the daemon's
client in ``kvtier.connector`` satisfies it over gRPC and shared memory, so the pool's spills
and the fall-through walk run unchanged either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash

if TYPE_CHECKING:
    import torch

ALREADY_STORED = -1
"""``reserve`` result: this tier or one below holds the hash (or is writing it)."""
NO_SPACE = -2
"""``reserve`` result: every slot is being read or written right now."""
NOT_ADMITTED = -3
"""``reserve`` result: the admission policy turned the block away (this copy of it need not
be offered again; a later offer of the hash is a new sighting). Over the wire it is
``NO_SPACE``."""
MAX_META_BYTES = 4096
"""Most bytes of engine metadata one block may carry, in every tier."""

DoneFn = Callable[[bool], None]


@dataclass(slots=True)
class LowerHits:
    """How many leading hashes the host, disk and remote tiers hold, as one prefix."""

    host: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        return self.host + self.disk + self.remote


class LowerTier(Protocol):
    """Batched two-phase access to the host tier and, through it, the tiers below."""

    slab: torch.Tensor
    """uint8 ``[num_slots, block_bytes]``: the host slots the copy engine reads and writes."""

    counters: TierCounters

    def lookup(self, hashes: Sequence[BlockHash]) -> LowerHits: ...

    def reserve(self, hashes: Sequence[BlockHash]) -> list[int]: ...

    def commit(self, slots: Sequence[int]) -> None: ...

    def abort(self, slots: Sequence[int]) -> None: ...

    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]: ...

    def release(self, slots: Sequence[int]) -> None: ...


class DiskTierLike(Protocol):
    """The disk tier as the host tier uses it (``kvtier.tiers.disk.tier.DiskTier``)."""

    block_bytes: int

    def contains(self, block_hash: BlockHash) -> bool: ...

    def holding(self, hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Which of ``hashes`` the tier holds, asked in one go."""

    def lookup_prefix(self, hashes: Sequence[BlockHash]) -> int: ...

    def get_into(self, block_hash: BlockHash, out: Any) -> bool: ...

    def get_meta(self, block_hash: BlockHash) -> bytes | None: ...

    def put(self, block_hash: BlockHash, data: Any, meta: bytes = b"", shed: bool = True) -> bool:
        """Stores a copy of ``data`` (taken before returning); False if it dropped the block
        instead (with ``shed``, when the disk is too far behind)."""

    def write_behind(
        self, block_hash: BlockHash, data: Any, meta: bytes = b"", on_done: DoneFn | None = None
    ) -> None:
        """Stores ``data`` without copying it here: the caller keeps it unchanged until
        ``on_done(ok)``, which comes exactly once."""


class RemoteTierLike(Protocol):
    """The remote tier as the host tier uses it (``kvtier.tiers.remote.tier.RemoteTier``)."""

    block_bytes: int

    def lookup_prefix(self, hashes: Sequence[BlockHash]) -> int: ...

    def get_into(self, hashes: Sequence[BlockHash], outs: Sequence[Any]) -> list[bytes]:
        """Fetches the leading blocks into ``outs``; returns the meta of each one fetched."""

    def write_behind(
        self, block_hash: BlockHash, data: Any, meta: bytes = b"", on_done: DoneFn | None = None
    ) -> None: ...
