"""Prometheus metrics: the tiers' counters read at scrape time, plus RPC latency histograms.

Counters live in the tiers as plain integers (``TierCounters``); a custom collector turns a
``Daemon.stats()`` snapshot into metric families on each scrape, so the hot path pays nothing
for Prometheus. Only RPC latencies are observed as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# counter field -> (metric name without the kvtier_ prefix, help)
_COUNTERS = {
    "query_tokens": ("query_tokens", "Tokens asked of the tier"),
    "hit_tokens": ("hit_tokens", "Tokens the tier held when asked"),
    "blocks_stored": ("blocks_stored", "Blocks committed into the tier"),
    "blocks_loaded": ("blocks_loaded", "Blocks read out of the tier"),
    "blocks_evicted": ("blocks_evicted", "Blocks evicted from the tier"),
    "blocks_spilled": ("blocks_spilled", "Evicted blocks written to the tier below"),
    "blocks_promoted": ("blocks_promoted", "Blocks promoted into the tier from below"),
    "blocks_deduplicated": ("blocks_deduplicated", "Stores skipped as already held"),
    "blocks_dropped": ("blocks_dropped", "Blocks dropped without being stored below"),
    "bytes_in": ("bytes_in", "Bytes written into the tier"),
    "bytes_out": ("bytes_out", "Bytes read out of the tier"),
    "checksum_failures": ("checksum_failures", "Blocks dropped for a bad checksum"),
    "fault_misses": ("fault_misses", "Blocks missed because the tier failed or timed out"),
    "breaker_trips": ("breaker_trips", "Times a circuit breaker cut the tier or a node off"),
}
_GAUGES = {
    "used_blocks": ("used_blocks", "Blocks held by the tier"),
    "capacity_blocks": ("capacity_blocks", "Blocks the tier can hold"),
    "used_bytes": ("used_bytes", "Bytes held by the tier"),
    "capacity_bytes": ("capacity_bytes", "Bytes the tier can hold"),
    "read_bytes_per_s": (
        "read_bytes_per_second",
        "Bytes a second the tier's reads delivered lately (disk, remote; an EWMA)",
    ),
}
_AGE = "oldest_block_age_s"
"""Only the tiers that keep times report it (host, disk), and the disk only once a time dates
its oldest block."""
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5)


class StatsCollector(Collector):
    """Metric families built from a stats snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        labels = ["tier", "layout"]
        for field, (name, doc) in _COUNTERS.items():
            family = CounterMetricFamily(f"kvtier_{name}", doc, labels=labels)
            for tier in stats["tiers"]:
                family.add_metric([tier["tier"], tier["layout"]], tier[field])
            yield family
        for field, (name, doc) in _GAUGES.items():
            family = GaugeMetricFamily(f"kvtier_{name}", doc, labels=labels)
            for tier in stats["tiers"]:
                family.add_metric([tier["tier"], tier["layout"]], tier[field])
            yield family
        age = GaugeMetricFamily(
            "kvtier_oldest_block_age_seconds",
            "Seconds since the tier's least recently used block was last used",
            labels=labels,
        )
        for tier in stats["tiers"]:
            if _AGE in tier:
                age.add_metric([tier["tier"], tier["layout"]], tier[_AGE])
        yield age
        # Counters added to TierCounters after this table still reach Prometheus.
        known = {"tier", "layout", _AGE, *_COUNTERS, *_GAUGES}
        for field in sorted({k for t in stats["tiers"] for k in t} - known):
            family = GaugeMetricFamily(f"kvtier_{field}", f"TierCounters.{field}", labels=labels)
            for tier in stats["tiers"]:
                family.add_metric([tier["tier"], tier["layout"]], tier.get(field, 0))
            yield family
        writing = GaugeMetricFamily(
            "kvtier_writing_behind_blocks",
            "Committed blocks whose disk write has not finished",
            labels=["layout"],
        )
        for layout in stats["layouts"]:
            writing.add_metric([layout["layout"]], layout["writing_behind"])
        yield writing
        for name, help_text in (
            ("holds_refused", "Host hits a lookup answered beyond the session's share of holds"),
            ("holds_expired", "Lookup holds that reached their deadline before an acquire"),
            ("holds_yielded", "Lookup holds ended early to give a promotion a slot"),
            ("holds_missed", "Host hits an index probe promised, evicted before its lookup came"),
        ):
            family = CounterMetricFamily(f"kvtier_lookup_{name}", help_text, labels=["layout"])
            for layout in stats["layouts"]:
                family.add_metric([layout["layout"]], layout[name])
            yield family
        yield from _pin_metrics(stats["layouts"])
        yield from _layout_metrics(stats["layout_blocks"])
        yield GaugeMetricFamily("kvtier_sessions", "Open client sessions", value=stats["sessions"])
        yield GaugeMetricFamily(
            "kvtier_reserved_slots",
            "Host slots reserved by sessions for stores under way",
            value=stats["reserved_slots"],
        )
        yield GaugeMetricFamily(
            "kvtier_reserved_ahead_slots",
            "Host slots reserved ahead of sessions' stores, no block in them yet",
            value=stats["reserved_ahead_slots"],
        )
        yield GaugeMetricFamily(
            "kvtier_acquired_slots",
            "Host slot reads held by sessions",
            value=stats["acquired_slots"],
        )
        yield GaugeMetricFamily(
            "kvtier_quarantined_slots",
            "Host slots of lost live clients held before reuse",
            value=stats["quarantined_slots"],
        )
        yield GaugeMetricFamily(
            "kvtier_watchers", "WatchEvents subscribers", value=stats["watchers"]
        )
        yield CounterMetricFamily(
            "kvtier_events_dropped",
            "Block events a slow watcher lost",
            value=stats["events_dropped"],
        )


def _pin_metrics(layouts: list[dict]) -> Iterator[Metric]:
    """Sessions' pins per layout: blocks kept now, and pins refused or missed so far."""
    pinned = GaugeMetricFamily(
        "kvtier_pinned_blocks", "Host blocks kept by sessions' pins", labels=["layout"]
    )
    refused = CounterMetricFamily(
        "kvtier_pins_refused", "Pins beyond a session's pin budget", labels=["layout"]
    )
    missed = CounterMetricFamily(
        "kvtier_pins_missed", "Pins of blocks the host tier never held committed", labels=["layout"]
    )
    for layout in layouts:
        pinned.add_metric([layout["layout"]], layout["pinned_blocks"])
        refused.add_metric([layout["layout"]], layout["pins_refused"])
        missed.add_metric([layout["layout"]], layout["pins_missed"])
    yield from (pinned, refused, missed)


def _layout_metrics(layouts: list[dict]) -> Iterator[Metric]:
    """Blocks per layout in the host and disk tiers, layouts on disk that no session opened
    since the start included (their count is read once, at start), and what each layout is."""
    blocks = GaugeMetricFamily(
        "kvtier_layout_blocks",
        "Blocks held per layout and tier (disk: also layouts no session opened since start)",
        labels=["layout", "tier", "block_tokens"],
    )
    info = GaugeMetricFamily(
        "kvtier_layout_info",
        "What a layout is (0 or empty: not known); open: a session opened it since start",
        labels=["layout", "block_tokens", "layers", "kv_heads", "head_size", "dtype", "open"],
    )
    for layout in layouts:
        tokens = str(layout["block_tokens"])
        if layout["open"]:
            blocks.add_metric([layout["layout"], "host", tokens], layout["host_blocks"])
        blocks.add_metric([layout["layout"], "disk", tokens], layout["disk_blocks"])
        shape = [str(layout[k]) for k in ("num_layers", "num_kv_heads", "head_size", "dtype")]
        opened = "true" if layout["open"] else "false"
        info.add_metric([layout["layout"], tokens, *shape, opened], 1)
    yield from (blocks, info)


class Metrics:
    """The daemon's registry: the stats collector, the RPC latency histogram and the slot
    channels' holds."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(snapshot))
        self.rpc_seconds = Histogram(
            "kvtier_rpc_seconds",
            "Daemon RPC latency by method and outcome",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.slot_channel_holds = Counter(
            "kvtier_slot_channel_holds",
            "Times the daemon stopped reading a slot channel until its client read its answers "
            "(or its waiting operations drained)",
            registry=self.registry,
        )
        self._rpc_children: dict[tuple[str, str], Histogram] = {}

    def observe(self, method: str, code: str, seconds: float) -> None:
        # ``labels`` checks and locks on every call: a few µs of each slot operation's ~60.
        child = self._rpc_children.get((method, code))
        if child is None:
            child = self._rpc_children[method, code] = self.rpc_seconds.labels(method, code)
        child.observe(seconds)
