"""Opening a disk tier directory: sizing, which blocks survive, and fitting the data file to the
budget.

An index found damaged before or while it is opened is moved aside and the tier starts empty
(``directory``). Entries of another layout or format, or past the end of the data file, are
dropped; the oldest blocks are evicted down to the budget; blocks in slots past a smaller
budget's end are moved into free slots below it (checksum verified, made durable before the
index points at them) so the file can shrink.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import lmdb
import xxhash

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk.commit import STAGED_BATCHES, DiskState
from kvtier.tiers.disk.directory import TierDirectory, is_damage
from kvtier.tiers.disk.index import BlockIndex, Entry
from kvtier.tiers.disk.slots import DATA_FILE, BufferPool, SlotFile, SlotTable, slot_stride
from kvtier.tiers.ratelog import RateLimitedLog
from kvtier.tiers.tunables import TUNABLES

log = logging.getLogger(__name__)

# Map bytes per slot: its index entry with the largest meta (two overflow pages), its order
# entry, B-tree pages and the pages older snapshots still hold, with room to spare; plus a
# slack for meta pages; the default map is never below ``disk_map_floor_bytes``. The map is
# address space only: the file grows as used.
_INDEX_BYTES = 12 << 10
_MAP_SLACK = 256 << 10


def plan(block_bytes: int, capacity_bytes: int, map_size: int | None) -> tuple[int, int, int]:
    """Returns (budget in blocks, most puts per batch, map size in bytes). The data file has
    ``STAGED_BATCHES`` batches of spare slots: a batch's payloads go into slots no entry names
    before its commit frees any, while the batch before it may still hold its own."""
    capacity = capacity_bytes // block_bytes
    if map_size is not None:
        capacity = min(capacity, (map_size - _MAP_SLACK) // _INDEX_BYTES)
    if capacity < 1:
        raise ValueError(
            f"capacity {capacity_bytes} B or map size {map_size} B holds no block of "
            f"{block_bytes} B"
        )
    batch = max(1, min(TUNABLES.disk_batch_bytes // block_bytes, capacity // 8))
    if map_size is None:
        map_size = max(
            TUNABLES.disk_map_floor_bytes, _MAP_SLACK + (capacity + batch) * _INDEX_BYTES
        )
    return capacity, batch, map_size


@dataclass(frozen=True, slots=True)
class Recovered:
    """What opening found: counts for the tier's counters and the slots left free."""

    used: int
    dropped: int
    evicted: int
    moved: int
    lost: int
    free_slots: list[int]


def open_state(
    directory: TierDirectory,
    signature: bytes,
    block_bytes: int,
    capacity_blocks: int,
    batch_blocks: int,
    open_index: Callable[[str], BlockIndex],
    counters: TierCounters,
) -> DiskState:
    """Opens the index (``open_index(path)``) and the data file in ``directory`` (held) and
    recovers their blocks; an index found damaged before or while doing so is moved aside and
    the tier starts empty. Returns the tier's shared state, ``counters`` set to what recovery
    found.
    """
    total_slots = capacity_blocks + STAGED_BATCHES * batch_blocks  # the spares: ``plan``
    pool = BufferPool(
        slot_stride(block_bytes), min(total_slots, TUNABLES.disk_pool_batches * batch_blocks)
    )

    def attempt() -> tuple[BlockIndex, SlotFile, Recovered]:
        index = open_index(directory.path)
        slots = None
        try:
            slots = SlotFile(os.path.join(directory.path, DATA_FILE), pool.size, pool)
            found = recover(
                index,
                slots,
                pool,
                signature=signature,
                block_bytes=block_bytes,
                capacity_blocks=capacity_blocks,
                total_slots=total_slots,
            )
        except BaseException:
            if slots is not None:
                slots.close()
            index.close()
            raise
        return index, slots, found

    directory.check()
    try:
        index, slots, found = attempt()
    except BaseException as exc:
        if not is_damage(exc):
            raise
        directory.move_aside(f"{type(exc).__name__}: {exc}")
        index, slots, found = attempt()
    directory.make_private()
    if found.dropped:
        log.warning(
            "disk tier %s: dropped %d blocks stored for another layout or format",
            directory.path,
            found.dropped,
        )
    if found.moved:
        log.info("disk tier %s: moved %d blocks into the smaller file", directory.path, found.moved)
    c = counters
    c.capacity_blocks, c.capacity_bytes = capacity_blocks, capacity_blocks * block_bytes
    c.blocks_evicted += found.dropped + found.evicted
    c.checksum_failures += found.lost
    c.used_blocks, c.used_bytes = found.used, found.used * block_bytes
    lock = threading.Lock()
    table = SlotTable(lock, found.free_slots)
    state = DiskState(
        directory.path,
        signature,
        block_bytes,
        index,
        slots,
        total_slots,
        table,
        pool,
        lock,
        threading.Condition(lock),
        counters,
        RateLimitedLog(logging.getLogger("kvtier.tiers.disk.tier")),
    )
    return state


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
