"""Under vLLM's Scheduler and a real daemon: kvtier's capacity gauges in vLLM's metrics,
and the load-or-recompute gate (a disk hit slower than the engine's prefill is recomputed,
and counted; one faster is loaded).

The engine's prefill rate is observed on a clock the test moves by a fixed step, so it does
not depend on how fast this machine runs the fake forward pass; the disk's rate is the
daemon's own measure of its reads, slowed for real by ``--disk-read-delay-ms``.
"""

from __future__ import annotations

import functools

import prometheus_client
import pytest

pytest.importorskip("vllm")

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.vllm.connector import KVTierConnector
from kvtier.connector.vllm.stats import KVTierStats

import vllmdaemon
import vllmharness as harness
from daemonutil import Daemon, wait_until
from tinymodel import BLOCK, BLOCK_BYTES
from vllmdaemon import daemon_stats
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
daemon = vllmdaemon.daemon
make_engine = harness.make_engine

SLOW_READ_MS = 200
"""A block of 4 KiB per 200 ms: 80 tokens a second, far below any engine's prefill."""
STEP_S = 0.1
"""Each step takes this long on the gate's clock: a 65-token prefill step is 650 tokens/s."""
LABELS = {"model_name": "tiny", "engine": "0"}


class StepClock:
    """Moves ``STEP_S`` each time it is read (the gate reads it once a step)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += STEP_S
        return self.now


@pytest.fixture
def slow_daemon():
    """A daemon whose disk crawls; tests ask for it before ``make_engine``, so that their
    engines are closed before it stops."""
    d = Daemon(
        host_bytes=64 * BLOCK_BYTES,
        disk_bytes=1024 * BLOCK_BYTES,
        extra=["--disk-read-delay-ms", str(SLOW_READ_MS)],
    )
    d.start()
    yield d
    d.cleanup()


def prom_metrics(engine) -> tuple[prometheus_client.CollectorRegistry, object]:
    """kvtier's metrics as vLLM builds them, in a registry of their own."""
    registry = prometheus_client.CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry)
        for kind in (
            prometheus_client.Gauge,
            prometheus_client.Counter,
            prometheus_client.Histogram,
        )
    }
    metrics = KVTierConnector.build_prom_metrics(
        engine.vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    return registry, metrics


def test_capacity_gauges_carry_the_daemons_values(make_engine, daemon) -> None:
    engine = make_engine()
    engine.add([*prompt(40, 4 * BLOCK), 1], "a")
    engine.run()
    wait_until(lambda: daemon_stats(daemon)["layouts"][0]["writing_behind"] == 0, "disk writes")
    side = engine.connector.scheduler
    assert side.hits.watch.refresh(timeout=60)
    engine.scheduler_stats = {}
    engine.step()  # vLLM takes the connector's stats: the fresh reading goes out now
    payload = engine.scheduler_stats
    after = {t["tier"]: t for t in daemon_stats(daemon)["tiers"]}
    for tier in ("host", "disk"):
        for name in ("used_bytes", "capacity_bytes", "used_blocks", "capacity_blocks"):
            assert payload[f"{name}.{tier}"] == after[tier][name], (name, tier)
    assert payload["used_blocks.host"] == 4
    assert payload["capacity_blocks.host"] == 64
    for tier in ("host", "disk"):
        age = payload[f"oldest_block_age_seconds.{tier}"]
        assert 0 <= age <= after[tier]["oldest_block_age_s"], tier

    # vLLM adds up the stats of many steps: gauges keep the latest reading, counters add.
    older = KVTierStats(data={"used_blocks.host": 1, "lookup_tokens": 5})
    summed = older.aggregate(KVTierStats(data=dict(payload)))
    assert summed.data["used_blocks.host"] == 4
    assert summed.data["lookup_tokens"] == 5 + payload.get("lookup_tokens", 0)

    registry, metrics = prom_metrics(engine)
    metrics.observe(payload, engine_idx=0)
    metrics.observe(payload, engine_idx=0)  # observed twice, still the reading
    host = {**LABELS, "tier": "host"}
    used = registry.get_sample_value("vllm:kvtier_used_bytes", host)
    assert used == after["host"]["used_bytes"] == 4 * BLOCK_BYTES
    assert registry.get_sample_value("vllm:kvtier_capacity_blocks", host) == 64
    for tier in ("host", "disk"):
        labels = {**LABELS, "tier": tier}
        age = registry.get_sample_value("vllm:kvtier_oldest_block_age_seconds", labels)
        assert age == payload[f"oldest_block_age_seconds.{tier}"], tier


def push_to_disk(engine, daemon, *prompts: list[int]) -> None:
    """Stores ``prompts`` through ``engine``, then fills the 64-slot host tier many times
    over so that their blocks are left on disk alone. Each batch waits for its disk writes:
    a slot being written down is pinned, and a store finding every slot pinned is dropped
    rather than evicting the older blocks."""
    for i, tokens in enumerate(prompts):
        engine.add(tokens, f"stored-{i}")
    engine.run()
    for i in range(5):
        wait_until(lambda: daemon_stats(daemon)["layouts"][0]["writing_behind"] == 0, "writes")
        engine.add([*prompt(300 + i, 20 * BLOCK), 1], f"filler-{i}")
        engine.run()


def gate_engine(make_engine, daemon, **kwargs):
    """An engine whose gate has seen prefill steps of a fresh prompt on the step clock."""
    engine = make_engine(daemon=daemon, **kwargs)
    engine.connector.scheduler.hits.gate.clock = StepClock()
    engine.add([*prompt(50, 4 * BLOCK), 1], "warm")
    engine.run()
    return engine


def run_probe_then_target(make_engine, daemon, **kwargs):
    """A probe's disk hit teaches the daemon its disk rate (taken: the gate knows no rate
    yet); then the target's disk hit meets the gate. Returns the second engine."""
    probe, target = prompt(51, 2 * BLOCK), prompt(52, 4 * BLOCK)
    push_to_disk(make_engine(daemon=daemon), daemon, [*probe, 1], [*target, 1])
    engine = gate_engine(make_engine, daemon, **kwargs)
    engine.add([*probe, 2], "probe")
    engine.run()
    assert engine.hit_sources.get(CacheHitSource.DISK) == 2 * BLOCK
    side = engine.connector.scheduler
    assert side.hits.watch.refresh(timeout=60)
    assert side.hits.watch.read_bytes_per_s["disk"] > 0
    engine.add([*target, 2], "target")
    engine.run()
    assert_scheduler_empty(engine.scheduler)
    return engine


def test_gate_recomputes_a_hit_on_a_crawling_disk(slow_daemon, make_engine) -> None:
    engine = run_probe_then_target(make_engine, slow_daemon, load_gate=True)
    gate = engine.connector.scheduler.hits.gate
    disk_tokens_per_s = engine.connector.scheduler.hits.watch.read_bytes_per_s["disk"] / (
        gate.bytes_per_token
    )
    assert disk_tokens_per_s < gate.prefill_tokens_per_s
    # The target's 4 disk blocks were recomputed, not loaded, and counted as declined.
    assert engine.hit_sources.get(CacheHitSource.DISK) == 2 * BLOCK  # the probe's alone
    assert engine.stats["loaded_blocks"] == 2
    assert engine.scheduler_stats["declined_hit_tokens.disk"] == 4 * BLOCK
    registry, metrics = prom_metrics(engine)
    metrics.observe(engine.scheduler_stats, engine_idx=0)
    declined = registry.get_sample_value(
        "vllm:kvtier_declined_hit_tokens_total", {**LABELS, "tier": "disk"}
    )
    assert declined == 4 * BLOCK


def test_without_the_gate_the_crawling_disk_is_loaded(slow_daemon, make_engine) -> None:
    engine = run_probe_then_target(make_engine, slow_daemon, load_gate=False)
    assert engine.hit_sources.get(CacheHitSource.DISK) == 6 * BLOCK
    assert "declined_hit_tokens.disk" not in engine.scheduler_stats


def test_gate_takes_a_hit_from_a_fast_disk(make_engine, daemon) -> None:
    engine = run_probe_then_target(make_engine, daemon, load_gate=True)
    gate = engine.connector.scheduler.hits.gate
    assert gate.prefill_tokens_per_s is not None
    assert engine.hit_sources.get(CacheHitSource.DISK) == 6 * BLOCK
    assert engine.stats["loaded_blocks"] == 6
    assert "declined_hit_tokens.disk" not in engine.scheduler_stats
