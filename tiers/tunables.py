"""The numbers that decide how the tiers behave, in one place, each with why it is what it is.

They are not flags: each one is a measured trade-off, and changing it changes the trade. The
tiers read the one instance, ``TUNABLES``; sizes a deployment chooses (tier capacities, the
flush interval) are arguments and daemon settings instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierTunables:
    switch_interval_s: float = 0.0005
    """The GIL switch interval of a process that runs the tiers: the daemon sets it, and so
    does ``kvtier bench tiers``, which measures the tiers as the daemon runs them. The disk
    tier's writer and I/O threads make many short calls that let the GIL go (LMDB, checksums
    between writes) while a caller's thread copies blocks in; under Python's default of 5 ms
    each of those threads waits up to that for the GIL back every time, and the device idles
    (a burst of 256 puts on the 2-core VM: 1.05-1.1 GB/s at 5 ms, 1.5-1.7 at 0.5 ms)."""

    promote_wait_s: float = 0.25
    """Most a promotion waits for a host slot to come free when every slot is in use: reads,
    writes behind and reservations end within milliseconds, and a hit the engine was promised
    is worth that wait more than a recompute."""

    disk_batch_bytes: int = 64 << 20
    """Most new bytes one disk batch writes (and at most an eighth of the budget): enough to
    amortise its fdatasync and LMDB commit; it is also the disk tier's number of spare slots."""

    disk_stage_bytes: int = 16 << 20
    """Payload bytes the disk writer sends to the device in one write while a batch still
    gathers: the device starts long before the batch closes, and each write is still big
    enough to keep the device's queue deep when the writer thread waits for a busy CPU."""

    disk_pool_batches: int = 2
    """Batches of returned put buffers the disk tier keeps warm, so a burst allocates none."""

    disk_put_backlog_bytes: int = 256 << 20
    """Most bytes of ``put`` copies waiting for the disk writer. A put beyond it drops its block
    (counted in ``blocks_dropped``): callers that outpace the device for long would otherwise
    grow the daemon's memory by a block's copy each, and they cannot wait instead (the host
    tier puts under its lock, which the writer's write-behind callbacks take)."""

    disk_map_floor_bytes: int = 64 << 20
    """Smallest LMDB map: address space only (the file grows as used), and room for a small
    tier's meta pages."""

    disk_deferred_touches: int = 4096
    """Access-order bumps that wait for the next commit that stores, drops or flushes: a read
    burst is not worth a synced commit of its own, and a crash loses only LRU precision."""

    disk_touch_bytes: int = 256 << 10
    """Smallest read whose fresh pages a helper thread faults in while the reader waits on the
    device: below it the hand-off costs more than the faults."""

    disk_verify_timeout_s: float = 600.0
    """A walk of an index of millions of blocks takes seconds; one that hangs this long is
    damage."""

    parallel_copy_bytes: int = 8 << 20
    """Smallest CPU copy split across threads: one core alone cannot saturate memory
    bandwidth, but a small copy is not worth waking the others."""

    staging_bytes: int = 128 << 20
    """GPU staging for engines whose KV order is not the canonical one: two slots of 32 MiB
    per direction, allocated once. Engines in the canonical order allocate none."""

    ring_id_buffers: int = 4
    """Pinned block-id buffers made with a copier that stages: one per transfer in flight
    through the ring, so no transfer allocates."""


TUNABLES = TierTunables()
