"""The numbers that decide how the daemon behaves, in one place, each with why it is what it is.

Not settings: each is a trade-off chosen once (what an operator sizes is in ``config``). The
daemon's parts read the one instance, ``TUNABLES``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DaemonTunables:
    get_chunk_blocks: int = 8
    """Blocks a ``Get`` holds at once: bounds the daemon's memory per stream."""

    inline_batch: int = 256
    """Batches up to this many hashes or slots may be served on the event loop; larger go to a
    thread."""

    rpc_workers: int = 8
    """Threads for calls that may touch the disk or a large batch: enough that a slow one never
    queues the rest behind it, few enough not to thrash a small host."""

    lookup_workers: int = 8
    """Threads for lookups that ask the tiers below: a remote store answering slowly holds one each
    for up to its lookup timeout, so they are kept apart from the slot operations."""

    slot_ops_in_flight: int = 256
    """Operations of one ``SlotOps`` stream running or waiting to be written; beyond that the
    daemon stops reading the stream, so a client that never reads its answers costs bounded
    memory."""

    watch_batch: int = 1024
    """Most events in one message."""

    small_request_bytes: int = 64 << 10
    """Largest encoded request a method not named in the per-method bounds may send: a malformed
    one is refused before it is decoded."""

    recent_calls: int = 256
    """Finished calls per session that ``Cancel`` can still undo."""

    cancelled_ids: int = 1024
    """Cancelled ids per session remembered, so that a call arriving after its Cancel does
    nothing."""

    released_ids: int = 4096
    """Sessions named by a reopen before the daemon saw them end, remembered so that their end
    gives their slots back at once."""

    max_lost_sessions: int = 64
    """Lost sessions one Open may name (a client names the few it lost since its last session)."""

    relay_respawn_s: float = 1.0
    """Pause before a relay that died is started again."""

    relay_connect_timeout_s: float = 10.0
    """How long a connection waits for room in gRPC's backlog before it is dropped."""

    relay_accept_pause_s: float = 0.1
    """How long accepting rests after the system ran out of descriptors or memory."""

    grpc_log_interval_s: float = 10.0
    """The same rate as the daemon's own refusals: one line per kind per ten seconds."""

    pin_pending_s: float = 5.0
    """How long a pinned block not committed yet waits for its commit before it counts as missed."""

    unverifiable_hold_s: float = 600.0
    """How long a lost session's slots stay held when the daemon cannot see its client's
    process, unless the client reopens naming it first."""


TUNABLES = DaemonTunables()
