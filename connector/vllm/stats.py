"""kvtier's counters and gauges inside vLLM's connector stats, its log line and its ``/metrics``.

Both sides count: the scheduler its lookups, the tokens each tier supplied and those the load
gate declined, every worker its copies, dedups and failures. vLLM sums the workers' and the
scheduler's ``KVTierStats`` each step (``aggregate``), logs ``reduce()`` periodically and feeds
the same dict to ``KVTierPromMetrics``, which exports one ``vllm:kvtier_<name>_total`` counter
per key. Per-tier keys are ``<name>.<tier>`` and become one metric labelled ``tier``. Gauges
(the daemon's capacity, as the scheduler last read it) are latest values: ``aggregate`` keeps
the newest instead of adding them up, and they are set, not incremented.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from kvtier.connector.client.daemon_client import DaemonClient

COUNTERS: dict[str, str] = {
    "lookup_tokens": "Prompt tokens whose blocks kvtier was asked about (once per admission)",
    "host_hit_tokens": "Tokens loaded from kvtier's host tier",
    "disk_hit_tokens": "Tokens loaded from kvtier's disk tier",
    "remote_hit_tokens": "Tokens loaded from kvtier's remote tier (shared by many nodes)",
    "daemon_failures": "kvtier daemon calls that failed (each counted as a miss)",
    "daemon_trips": "Times a worker found the daemon not answering (calls miss until it answers)",
    "loaded_blocks": "Blocks copied from kvtier into vLLM's KV cache",
    "load_failed_blocks": "Blocks whose load failed and were recomputed",
    "stored_blocks": "Blocks copied from vLLM's KV cache into kvtier",
    "deduplicated_blocks": "Blocks not stored because kvtier already held them",
    "store_failed_blocks": "Blocks not stored (no free slot, daemon down or commit refused)",
    "loaded_bytes": "Bytes copied from kvtier into vLLM's KV cache",
    "stored_bytes": "Bytes copied from vLLM's KV cache into kvtier",
    "vllm_mismatches": "Calls in which a vLLM object lacked what the connector reads (a vLLM "
    "newer than the connector knows): each costs external hits, never the engine's step",
}
TIERS = ("host", "disk", "remote")
TIER_COUNTERS: dict[str, str] = {
    "declined_hit_tokens": "Hit tokens the load gate left to recompute: the tier would deliver "
    "them slower than the engine computes them",
}
GAUGES: dict[str, str] = {
    "used_bytes": "Bytes the kvtier tier holds (all of this engine's layouts)",
    "capacity_bytes": "Bytes the kvtier tier can hold (all of this engine's layouts)",
    "used_blocks": "Blocks the kvtier tier holds (all of this engine's layouts)",
    "capacity_blocks": "Blocks the kvtier tier can hold (all of this engine's layouts)",
    "oldest_block_age_seconds": "Seconds since the kvtier tier's least recently used block "
    "was last used (host, disk; the disk's is an upper bound about a second over)",
}
SIGNALS: dict[str, str] = {
    "workers_unanswered": "Workers whose breaker was open when they reported: the scheduler "
    "opens its own (a trip already over, the daemon answering again, is not followed)",
}
"""What workers tell the scheduler and nobody else: neither exported nor logged."""
_GAUGE_KEYS = frozenset(f"{name}.{tier}" for name in GAUGES for tier in TIERS)
_KEYS = (
    frozenset(COUNTERS)
    | {f"{name}.{tier}" for name in TIER_COUNTERS for tier in TIERS}
    | frozenset(SIGNALS)
)


class KVTierStats(KVConnectorStats):
    """Integer counters since the last report, keyed as in ``COUNTERS`` (``TIER_COUNTERS``
    as ``<name>.<tier>``), and the latest gauges, keyed ``<name>.<tier>`` of ``GAUGES``."""

    def add(self, key: str, value: int) -> None:
        if key not in _KEYS:
            raise KeyError(f"unknown kvtier counter {key!r}")
        if value:
            self.data[key] = self.data.get(key, 0) + value

    def set_gauges(self, values: dict[str, float]) -> None:
        """Latest values of gauges keyed ``<name>.<tier>``."""
        unknown = set(values) - _GAUGE_KEYS
        if unknown:
            raise KeyError(f"unknown kvtier gauges {sorted(unknown)}")
        self.data.update(values)

    def take(self) -> KVTierStats | None:
        """The counts so far (None if all zero), and a fresh start."""
        if self.is_empty():
            return None
        taken = KVTierStats(data=self.data)
        self.data = {}
        return taken

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in _GAUGE_KEYS:
                self.data[key] = value  # a level, not a count: the newer reading stands
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {
            key: value for key, value in self.data.items() if key not in SIGNALS
        }
        lookups = reduced.get("lookup_tokens", 0)
        if lookups:
            hits = sum(reduced.get(f"{tier}_hit_tokens", 0) for tier in ("host", "disk", "remote"))
            reduced["hit_rate"] = round(hits / lookups, 4)
        return reduced

    def is_empty(self) -> bool:
        return not any(value or key in _GAUGE_KEYS for key, value in self.data.items())


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvtier key, labelled like vLLM's own metrics (and ``tier``
    for per-tier keys), and a gauge per ``GAUGES`` name."""

    def __init__(
        self,
        vllm_config,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, documentation in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:kvtier_{key}", documentation=documentation, labelnames=labelnames
            )
            self._counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        tiered = [*labelnames, "tier"]
        for name, documentation in TIER_COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=documentation, labelnames=tiered
            )
            self._counters.update(_per_tier(name, metric, per_engine_labelvalues))
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, documentation in GAUGES.items():
            metric = self._gauge_cls(
                name=f"vllm:kvtier_{name}",
                documentation=documentation,
                labelnames=tiered,
                multiprocess_mode="mostrecent",
            )
            self._gauges.update(_per_tier(name, metric, per_engine_labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            gauge = self._gauges.get(key)
            if gauge is not None:
                gauge[engine_idx].set(value)
                continue
            per_engine = self._counters.get(key)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)


def _per_tier(
    name: str, metric: Any, per_engine_labelvalues: dict[int, list[object]]
) -> dict[str, dict[int, Any]]:
    """``<name>.<tier>`` → engine index → the metric's child for that engine and tier."""
    return {
        f"{name}.{tier}": {
            idx: metric.labels(*values, tier) for idx, values in per_engine_labelvalues.items()
        }
        for tier in TIERS
    }


def follow_worker_trips(reported: KVTierStats | None, clients: Iterable[DaemonClient]) -> None:
    """Opens the scheduler's breakers when a worker reported its own open (``SIGNALS``).

    A worker in a process of its own waits out deadlines: lookups sent now would each wait one
    too, and the requests behind them. Only a breaker still open when the worker reported
    counts: a trip already over (the daemon restarted between two steps and answers again)
    would make the next lookups miss for nothing. (A worker in this process shares the
    breaker, which then is open already.)"""
    if reported is None or not reported.data.get("workers_unanswered"):
        return
    for client in clients:
        if not client.breaker.is_open:
            client.breaker.trip("a worker found the daemon not answering")


class DaemonTrouble:
    """Counts one side's daemon failures, and with ``trips`` its breaker trips and whether
    one is open now, into its ``KVTierStats``. Only workers count trips: a scheduler in a
    worker's process shares its breaker, and one in a process of its own opens its breaker
    when a worker reports one open."""

    def __init__(self, trips: bool) -> None:
        self._count_trips = trips
        self._failures = 0
        self._trips = 0

    def count(self, clients: Iterable[DaemonClient], stats: KVTierStats) -> None:
        """Adds what happened since the last count."""
        clients = list(clients)
        failures = sum(client.failures for client in clients)
        trips = _breaker_trips(clients)
        stats.add("daemon_failures", failures - self._failures)
        if self._count_trips:
            stats.add("daemon_trips", trips - self._trips)
            stats.add("workers_unanswered", int(any(c.breaker.is_open for c in clients)))
        self._failures, self._trips = failures, trips


def _breaker_trips(clients: Iterable[DaemonClient]) -> int:
    """How often the clients' breakers opened (clients of one daemon in a process share one:
    it counts once)."""
    breakers = {id(client.breaker): client.breaker for client in clients}
    return sum(breaker.trips for breaker in breakers.values())
