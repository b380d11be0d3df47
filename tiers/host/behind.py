"""The host tier's writes behind: committed blocks written from their slots to the tiers below.

With ``write_behind`` (the daemon) a committed block is readable at once and is written to the
disk and remote tiers straight from its slot, without a copy, so the slot stays pinned until
every such write is done. ``HostTier`` owns one ``WriteBehind``; the admission policy may keep
a block off the disk at commit and send it there later, when it is first hit.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

import numpy as np

from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host.slots import SlotTable
from kvtier.tiers.lower import DiskTierLike, RemoteTierLike

Below = DiskTierLike | RemoteTierLike


class WriteBehind:
    """Pins slots for their writes to the tiers below, starts the writes, unpins when done."""

    def __init__(
        self,
        tiers: Sequence[Below],
        disk: DiskTierLike | None,
        changed: threading.Condition,
        table: SlotTable,
        slab: np.ndarray,
    ):
        """``tiers`` are written behind (none: blocks go down only when evicted); ``disk``
        is the one of them an admission policy may skip; ``changed`` is the host tier's
        lock and condition, ``table`` and ``slab`` its slots."""
        self._tiers = list(tiers)
        self._disk = disk if disk in self._tiers else None
        self._changed = changed
        self._table = table
        self._slab = slab
        self._left: dict[int, int] = {}  # slot -> writes not finished yet

    def __len__(self) -> int:
        """Slots with a write not finished yet; call under the lock."""
        return len(self._left)

    def tiers(self, disk: bool = True) -> list[Below]:
        """The tiers a commit writes to, the disk only if ``disk``."""
        return [t for t in self._tiers if disk or t is not self._disk]

    def missing_on_disk(self, block_hash: BlockHash) -> list[Below]:
        """The disk, if it is written behind and lacks ``block_hash``; else nothing."""
        disk = self._disk
        return [disk] if disk is not None and not disk.contains(block_hash) else []

    def pin(self, slot: int, tiers: Sequence[Below]) -> None:
        """Pins ``slot`` once per write to ``tiers``; call under the lock."""
        for _ in tiers:
            self._table.pin(slot)
        if tiers:
            self._left[slot] = self._left.get(slot, 0) + len(tiers)

    def start(self, slot: int, block_hash: BlockHash, meta: bytes, tiers: Sequence[Below]):
        """Starts the writes ``pin`` pinned ``slot`` for; call without the lock."""
        for tier in tiers:
            tier.write_behind(block_hash, self._slab[slot], meta, partial(self._written, slot))

    def _written(self, slot: int, ok: bool) -> None:
        """One write of the slot finished; the tier below counts a failure (``ok`` False)
        itself. The slot stays pinned until every such write is done."""
        with self._changed:
            left = self._left.pop(slot) - 1
            if left:
                self._left[slot] = left
            self._table.unpin(slot)
            self._changed.notify_all()
