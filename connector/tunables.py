"""The numbers that decide how the engine side behaves, in one place, each with why it is what
it is.

Not settings: each is a trade-off chosen once (what a user chooses is in
``vllm.config.KVTierConfig``). The client and the connector read the one instance, ``TUNABLES``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTunables:
    first_probe_s: float = 0.05
    """First wait before an open breaker probes the daemon: a restart is back within tens of
    milliseconds."""

    max_probe_s: float = 1.0
    """Longest wait between probes of a daemon that stays down: a health check a second costs
    nothing and finds it soon after it is back."""

    repair_timeout_s: float = 30.0
    """Deadline of a call sent without waiting (release, abort, cancel): long, since giving up
    the session is the only remedy if it fails, and a daemon frozen for a while should not cost
    the session. Nothing waits on it while the breaker is open."""

    max_reopen_backoff_s: float = 2.0
    """Longest wait between attempts to open a session: a daemon that comes back is used within two
    seconds, one that stays away is not hammered."""

    stream_retry_s: float = 1.0
    """Pause after a session's ``SlotOps`` stream broke before the next one opens (its calls go
    unary meanwhile): a stream the daemon keeps ending is not reopened on every call."""

    capacity_refresh_s: float = 2.0
    """Capacity moves slowly and a Stats call walks every layout: a few seconds is fresh enough."""

    host_bytes_per_s: float = 16e9
    """A host hit is a copy out of pinned shared memory (DMA over PCIe, or a memcpy on a CPU
    engine): some 16 GB/s on current hosts, faster than any engine recomputes its KV."""

    prefill_weight: float = 0.2
    """Weight of the newest step in the prefill rate: a few steps follow a change of load, one
    stalled step does not swing it."""

    max_events_per_step: int = 1 << 14
    """Most events handed to one step's batch (a replay of a large disk tier spans steps)."""

    resubscribe_wait_s: float = 5.0
    """Wait before watching again after the stream broke for another reason than lost events (a
    daemon restarting): long enough not to spin, short enough for routers."""

    starved_load_s: float = 30.0
    """A load that finds no room for this long fails its remaining blocks (vLLM recomputes them)
    rather than keep its request waiting: room comes back within one acquire's deadline unless
    slots leaked, and no request may wait on that forever."""

    max_buffered_events: int = 1 << 16
    """Most translated events waiting for vLLM's next step; the stream waits beyond that."""


TUNABLES = EngineTunables()
