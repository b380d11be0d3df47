"""The host tier: one slab of (pinned) host memory cut into block-sized slots.

A hash→slot index, LRU over committed slots nobody is reading, and two-phase transfers:

* store: ``reserve`` → the caller writes the slot → ``commit`` (or ``abort``). A reserved slot
  is in the index, so nobody reserves the same hash twice, but it is never readable.
* load: ``acquire`` → the caller reads the slot → ``release``. An acquired slot is never
  evicted. Acquiring a hash that only the disk tier holds promotes it into a slot first.

When a slot is needed and none is free, the least recently used committed slot is evicted
**into the disk tier** (spill) unless the disk already holds it. The slab can be our own
allocation or a caller's buffer (the daemon's shared-memory arena).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.hashing import BlockHash, check_hash
from kvtier.tiers.pinned import allocate_host

ALREADY_STORED = -1
"""``reserve`` result: this tier or the one below holds the hash (or is writing it)."""
NO_SPACE = -2
"""``reserve`` result: every slot is being read or written right now."""

_FREE, _WRITING, _READY = 0, 1, 2


@dataclass(slots=True)
class LowerHits:
    """How many leading hashes the host and disk tiers hold, as one contiguous prefix."""

    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.host + self.disk


class HostTier:
    """Fixed-slot block store in host memory, spilling its LRU slots into a ``DiskTier``."""

    def __init__(
        self,
        block_bytes: int,
        capacity_bytes: int,
        *,
        buffer: torch.Tensor | None = None,
        pin: bool | None = None,
        lower: DiskTier | None = None,
        counters: TierCounters | None = None,
        on_event: Callable[[str, BlockHash], None] | None = None,
    ):
        """``on_event(kind, hash)`` hears "stored" and "removed"; it may run under the tier's
        lock, so it must only hand the event on (a queue), never call back into the tier."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"host capacity {capacity_bytes} B holds no block of {block_bytes} B")
        if lower is not None and lower.block_bytes != block_bytes:
            raise ValueError(f"disk tier blocks are {lower.block_bytes} B, host {block_bytes} B")
        if buffer is None:
            buffer = allocate_host(num_slots * block_bytes, pin)
        elif buffer.dtype != torch.uint8 or buffer.numel() < num_slots * block_bytes:
            raise ValueError(f"host buffer must be uint8 with >= {num_slots * block_bytes} bytes")
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.slab = buffer[: num_slots * block_bytes].view(num_slots, block_bytes)
        self._slab_np = self.slab.numpy()
        self.lower = lower
        self.counters = counters or TierCounters("host")
        self.counters.capacity_blocks = num_slots
        self.counters.capacity_bytes = num_slots * block_bytes
        self._on_event = on_event
        self._lock = threading.Lock()
        self._promoted = threading.Condition(self._lock)
        self._index: dict[BlockHash, int] = {}
        self._slot_hash: list[BlockHash | None] = [None] * num_slots
        self._state = [_FREE] * num_slots
        self._refs = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._promoting: set[int] = set()

    # ---------------------------------------------------------------- queries

    def contains(self, block_hash: BlockHash) -> bool:
        """True if a committed slot holds ``block_hash``."""
        slot = self._index.get(block_hash)
        return slot is not None and self._state[slot] == _READY

    def lookup(self, hashes: Sequence[BlockHash]) -> LowerHits:
        """The contiguous prefix of ``hashes`` that this tier or the disk tier holds."""
        for h in hashes:
            check_hash(h)
        hits = LowerHits()
        pos, n = 0, len(hashes)
        with self._lock:
            while pos < n:
                if self._ready(hashes[pos]):
                    hits.host += 1
                    pos += 1
                    continue
                run = self.lower.lookup_prefix(hashes[pos:]) if self.lower else 0
                if run == 0:
                    break
                for h in hashes[pos : pos + run]:
                    if self._ready(h):
                        hits.host += 1
                    else:
                        hits.disk += 1
                pos += run
        return hits

    def slot_array(self, slot: int) -> np.ndarray:
        """The bytes of one slot as a writable numpy view (no copy)."""
        return self._slab_np[slot]

    # ------------------------------------------------------------------ store

    def reserve(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Reserves a slot for each hash; ``ALREADY_STORED`` or ``NO_SPACE`` where it can't.

        The hash is claimed at once (a second reserve of it sees ``ALREADY_STORED``) but the
        slot is unreadable until ``commit``.
        """
        for h in hashes:
            check_hash(h)
        result: list[int] = []
        with self._lock:
            for h in hashes:
                if h in self._index or (self.lower is not None and self.lower.contains(h)):
                    self.counters.blocks_deduplicated += 1
                    result.append(ALREADY_STORED)
                    continue
                slot = self._take_slot()
                if slot is None:
                    result.append(NO_SPACE)
                    continue
                self._claim(slot, h)
                result.append(slot)
        return result

    def commit(self, slots: Sequence[int]) -> None:
        """Makes reserved slots readable; their hashes are now stored here."""
        stored: list[BlockHash] = []
        with self._lock:
            for slot in slots:
                self._check_state(slot, _WRITING, "commit")
                self._state[slot] = _READY
                self._lru[slot] = None
                self.counters.blocks_stored += 1
                self.counters.bytes_in += self.block_bytes
                stored.append(self._slot_hash[slot])
        self._emit("stored", stored)

    def abort(self, slots: Sequence[int]) -> None:
        """Gives reserved slots back unwritten; their hashes are not stored."""
        with self._lock:
            for slot in slots:
                self._check_state(slot, _WRITING, "abort")
                self._drop(slot)

    # ------------------------------------------------------------------- load

    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pins slots holding ``hashes`` for reading, promoting disk hits into slots.

        Stops at the first hash that neither tier can supply (gone since the lookup, no free
        slot, or a checksum miss on disk), so the result is a prefix of ``hashes``. Every
        returned slot must be given back with ``release``.
        """
        for h in hashes:
            check_hash(h)
        acquired: list[int] = []
        for h in hashes:
            slot = self._acquire_one(h)
            if slot is None:
                break
            acquired.append(slot)
        return acquired

    def release(self, slots: Sequence[int]) -> None:
        """Ends reads begun by ``acquire``."""
        with self._lock:
            for slot in slots:
                self._check_state(slot, _READY, "release")
                if self._refs[slot] <= 0:
                    raise ValueError(f"slot {slot} released more often than acquired")
                self._refs[slot] -= 1
                if self._refs[slot] == 0:
                    self._lru[slot] = None

    def spill_all(self) -> int:
        """Copies every committed block the disk tier lacks into it (graceful shutdown).

        Returns how many blocks were spilled; the slots stay valid.
        """
        if self.lower is None:
            return 0
        spilled = 0
        with self._lock:
            for block_hash, slot in self._index.items():
                if self._state[slot] == _READY and not self.lower.contains(block_hash):
                    self.lower.put(block_hash, self._slab_np[slot])
                    spilled += 1
            self.counters.blocks_spilled += spilled
        return spilled

    # -------------------------------------------------------------- internals

    def _ready(self, block_hash: BlockHash) -> bool:
        slot = self._index.get(block_hash)
        return slot is not None and self._state[slot] == _READY

    def _acquire_one(self, block_hash: BlockHash) -> int | None:
        with self._lock:
            while True:
                slot = self._index.get(block_hash)
                if slot is None:
                    break
                if self._state[slot] == _READY:
                    self._pin(slot)
                    self.counters.blocks_loaded += 1
                    self.counters.bytes_out += self.block_bytes
                    return slot
                if slot not in self._promoting:
                    return None  # a store still being written is not readable yet
                # Another thread is promoting this hash from disk: its read is short, wait.
                self._promoted.wait()
            if self.lower is None or not self.lower.contains(block_hash):
                return None
            slot = self._take_slot()
            if slot is None:
                return None
            self._claim(slot, block_hash)
            self._promoting.add(slot)
        # The disk read runs outside the lock; the claimed slot keeps others off this hash.
        ok = self.lower.get_into(block_hash, self._slab_np[slot])
        with self._lock:
            self._promoting.discard(slot)
            if ok:
                self._state[slot] = _READY
                self._pin(slot)
                self.counters.blocks_promoted += 1
                self.counters.blocks_loaded += 1
                self.counters.bytes_out += self.block_bytes
            else:
                self._drop(slot)
            self._promoted.notify_all()
        return slot if ok else None

    def _pin(self, slot: int) -> None:
        self._refs[slot] += 1
        self._lru.pop(slot, None)

    def _claim(self, slot: int, block_hash: BlockHash) -> None:
        self._state[slot] = _WRITING
        self._slot_hash[slot] = block_hash
        self._index[block_hash] = slot
        self.counters.used_blocks += 1
        self.counters.used_bytes += self.block_bytes

    def _drop(self, slot: int) -> None:
        del self._index[self._slot_hash[slot]]
        self._slot_hash[slot] = None
        self._state[slot] = _FREE
        self._free.append(slot)
        self.counters.used_blocks -= 1
        self.counters.used_bytes -= self.block_bytes
        self._promoted.notify_all()

    def _take_slot(self) -> int | None:
        """A free slot, evicting the LRU committed slot into the disk tier if need be."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        victim = self._slot_hash[slot]
        if self.lower is not None and not self.lower.contains(victim):
            self.lower.put(victim, self._slab_np[slot])
            self.counters.blocks_spilled += 1
        self.counters.blocks_evicted += 1
        self._drop(slot)
        self._emit("removed", [victim])
        return self._free.pop()

    def _check_state(self, slot: int, want: int, op: str) -> None:
        if not 0 <= slot < self.num_slots or self._state[slot] != want:
            raise ValueError(f"{op}: slot {slot} is not in the state {op} needs")

    def _emit(self, kind: str, hashes: list[BlockHash]) -> None:
        if self._on_event is not None:
            for h in hashes:
                self._on_event(kind, h)
