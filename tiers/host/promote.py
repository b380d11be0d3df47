"""How the host tier promotes a lower tier's hits into its slots for an acquire.

``HostTier`` owns one ``Promoter``, kept apart because promotion is the one path that reads
the tiers below while holding claimed slots, waits for room and gives up the lock to end
lookup holds. What it may do to the host tier's slots is exactly ``SlotOps``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host.behind import WriteBehind
from kvtier.tiers.host.slots import READY, SlotTable
from kvtier.tiers.lower import DiskTierLike, LowerHits, RemoteTierLike
from kvtier.tiers.tunables import TUNABLES


@dataclass(frozen=True)
class SlotOps:
    """The host tier's slots as promotion sees them. Every operation is called with
    ``changed``'s lock (the host tier's lock) held."""

    changed: threading.Condition
    """The host tier's lock and condition: notified when a slot may have come free."""
    table: SlotTable
    slab: np.ndarray
    """One row of bytes per slot."""
    take: Callable[[], int | None]
    """A free slot, evicting (and spilling) the least recently used one if need be."""
    claim: Callable[[int, BlockHash, bytes], None]
    drop: Callable[[int], BlockHash]
    emit: Callable[[str, BlockHash, bytes], None]
    """Announces "stored" or "removed" for a hash and its meta."""
    behind: WriteBehind
    """Pins slots for writes to the tiers below and starts them."""


class Promoter:
    """Reads lower-tier hits into host slots, pinned once for the acquiring caller."""

    def __init__(
        self,
        slots: SlotOps,
        lower: DiskTierLike | None,
        remote: RemoteTierLike | None,
        counters: TierCounters,
    ):
        self._ops = slots
        self._lock = slots.changed
        self._changed = slots.changed
        self._slots = slots.table
        self._slab_np = slots.slab
        self.lower = lower
        self.remote = remote
        self.counters = counters
        self._promoting: set[int] = set()
        self.reclaim: Callable[[], bool] | None = None
        """Ends the oldest lookup hold when every slot is pinned; True if it ended one.
        Called without the lock (it releases slots through the host tier)."""

    def promote(
        self, hashes: Sequence[BlockHash], found: list[int | None], pos: int, sources: LowerHits
    ) -> list[int]:
        """Promotes the run of non-resident hashes starting at ``pos``; returns its slots.

        A disk hit is read into a claimed slot one block at a time; a run the disk lacks is
        fetched from the remote tier in one batched call. The reads run outside the lock;
        the claimed slots keep every other caller off these hashes meanwhile.
        """
        end = pos
        while end < len(hashes) and found[end] is None:
            end += 1
        slot = self._acquire_one(hashes[pos])
        if slot is not None:
            sources.disk += 1
            return [slot]
        if self.remote is None:
            return []
        return self._promote_remote(hashes[pos:end], sources)

    def _acquire_one(self, block_hash: BlockHash) -> int | None:
        """Promotes one disk hit into a pinned slot, or None.

        When every slot is in use, it first ends lookup holds (``reclaim``), then waits up to
        ``promote_wait_s`` for a slot to come free: reads, writes behind and reservations end
        within milliseconds, and a hit the engine was promised is worth that wait more than a
        recompute.
        """
        deadline = time.monotonic() + TUNABLES.promote_wait_s
        with self._lock:
            while True:
                slot = self._slots.index.get(block_hash)
                if slot is not None:
                    if self._slots.state[slot] == READY:
                        self._slots.pin(slot)  # another caller promoted it meanwhile
                        return slot
                    if slot not in self._promoting:
                        return None  # a store still being written is not readable yet
                    self._changed.wait()  # another caller is promoting it: its read is short
                    continue
                if self.lower is None or not self.lower.contains(block_hash):
                    return None
                slot = self._ops.take()
                if slot is not None:
                    break
                if self._reclaim_unlocked():
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            self._ops.claim(slot, block_hash, self.lower.get_meta(block_hash) or b"")
            self._promoting.add(slot)
        ok = self.lower.get_into(block_hash, self._slab_np[slot])
        with self._lock:
            self._promoting.discard(slot)
            if ok:
                self._ready_promoted(slot)
            else:
                self._ops.drop(slot)
            self._changed.notify_all()
        return slot if ok else None

    def _reclaim_unlocked(self) -> bool:
        """Runs ``reclaim`` with the lock (held by the caller) given up meanwhile, since it
        releases slots through this tier."""
        if self.reclaim is None:
            return False
        self._lock.release()
        try:
            return self.reclaim()
        finally:
            self._lock.acquire()

    def _promote_remote(self, hashes: Sequence[BlockHash], sources: LowerHits) -> list[int]:
        """Fetches a run of hashes from the remote tier into pinned slots (disk too)."""
        claimed: list[int] = []
        with self._lock:
            for h in hashes:
                if h in self._slots.index:
                    break  # someone else is storing or promoting it: stop the run here
                slot = self._ops.take()
                if slot is None:
                    break
                self._ops.claim(slot, h, b"")
                self._promoting.add(slot)
                claimed.append(slot)
        metas = self.remote.get_into(hashes[: len(claimed)], [self._slab_np[s] for s in claimed])
        got = claimed[: len(metas)]
        with self._lock:
            for slot, meta in zip(got, metas, strict=True):
                if meta:
                    self._slots.meta[slot] = meta
                self._promoting.discard(slot)
                self._ready_promoted(slot)
            for slot in claimed[len(got) :]:
                self._promoting.discard(slot)
                self._ops.drop(slot)
            self._changed.notify_all()
        sources.remote += len(got)
        if self.lower is not None:
            self._write_down(got)
        return got

    def _write_down(self, slots: list[int]) -> None:
        """A remote hit lands in the disk tier too, written from its slot (pinned until the
        write is done), as a commit's is: no copy of its own per block, so however many
        blocks a promotion brings, the memory they take is the host slots they are in."""
        disk, blocks = [self.lower], []
        with self._lock:
            for slot in slots:
                self._ops.behind.pin(slot, disk)
                blocks.append((slot, self._slots.hash_of(slot), self._slots.meta.get(slot, b"")))
        for block in blocks:
            self._ops.behind.start(*block, disk)

    def _ready_promoted(self, slot: int) -> None:
        """A promoted slot becomes readable, pinned once for the caller; call under the lock."""
        self._slots.state[slot] = READY
        self._slots.refs[slot] = 1
        self.counters.blocks_promoted += 1
        self._ops.emit("stored", [(self._slots.hash_of(slot), self._slots.meta.get(slot, b""))])
