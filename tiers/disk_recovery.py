"""Opening a disk tier directory: which blocks survive, and fitting the data file to the budget.

Entries of another layout or format, or past the end of the data file, are dropped; the
oldest blocks are evicted down to the budget; blocks in slots past a smaller budget's end are
moved into free slots below it (checksum verified, made durable before the index points at
them) so the file can shrink.
"""

from __future__ import annotations

from dataclasses import dataclass

import lmdb
import xxhash

from kvtier.tiers.disk_index import BlockIndex, Entry
from kvtier.tiers.disk_slots import BufferPool, SlotFile


@dataclass(frozen=True, slots=True)
class Recovered:
    """What opening found: counts for the tier's counters and the slots left free."""

    used: int
    dropped: int
    evicted: int
    moved: int
    lost: int
    free_slots: list[int]


def recover(
    index: BlockIndex,
    slots: SlotFile,
    pool: BufferPool,
    *,
    signature: bytes,
    block_bytes: int,
    capacity_blocks: int,
    total_slots: int,
) -> Recovered:
    """Keeps the entries this tier can use, evicts down to the budget and fits the data file
    to ``total_slots``, first moving blocks past its new end into free slots below."""
    file_slots = 0 if slots.created else slots.slots
    with index.write() as txn:
        # A wrong length is left to the first read, which counts it as corrupt.
        entries, dropped = index.load(
            txn, lambda e: e.signature == signature and 0 <= e.slot < file_slots
        )
        evicted = index.evict(txn, len(entries) - capacity_blocks)
        for block_hash, _ in evicted:
            del entries[block_hash]
        moved, lost = _move_below(txn, index, slots, pool, entries, block_bytes, total_slots)
    slots.resize(total_slots)
    free = sorted(set(range(total_slots)) - {e.slot for e in entries.values()})
    return Recovered(len(entries), dropped, len(evicted), moved, lost, free)


def _move_below(
    txn: lmdb.Transaction,
    index: BlockIndex,
    slots: SlotFile,
    pool: BufferPool,
    entries: dict[bytes, Entry],
    block_bytes: int,
    total_slots: int,
) -> tuple[int, int]:
    """Moves blocks from slots past ``total_slots`` into free ones (a budget made smaller);
    updates ``entries``. Returns (blocks moved, blocks dropped for a bad checksum)."""
    outside = [(h, e) for h, e in entries.items() if e.slot >= total_slots]
    if not outside:
        return 0, 0
    used = {e.slot for e in entries.values()}
    free = iter(sorted(set(range(total_slots)) - used))
    buf = pool.acquire()
    lost = 0
    with memoryview(buf) as view:
        payload = view[:block_bytes]
        for block_hash, entry in outside:
            slots.read_into(entry.slot, payload)
            if xxhash.xxh3_64_intdigest(payload) != entry.checksum:
                index.delete(txn, block_hash, entry)
                del entries[block_hash]
                lost += 1
                continue
            slot = next(free)  # the budget's slots hold every survivor
            slots.write([(slot, view)])
            entries[block_hash] = entry._replace(slot=slot)
        payload.release()
    pool.release(buf)
    slots.sync()  # the bytes are in their new slots before the index says so
    for block_hash, _ in outside:
        if block_hash in entries:
            index.replace(txn, block_hash, entries[block_hash])
    return len(outside) - lost, lost
