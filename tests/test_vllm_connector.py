"""KVTierConnector under real vLLM, 0.33 and 0.34 (``vllmharness``): prefixes computed once
then loaded bit-exact in every KV layout, store policies, disk round trips, a killed daemon,
preemption, aborts, statistics and metrics.

Run in a venv with vLLM (see README): ``VLLM_TARGET_DEVICE=cpu pytest -m vllm``.
"""

from __future__ import annotations

import functools
import os
import signal

import prometheus_client
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

import torch
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvtier.connector.vllm.config import KVTierConfig
from kvtier.connector.vllm.connector import KVTierConnector
from kvtier.connector.vllm.groups import groups_from_kv_cache_config
from kvtier.connector.vllm.layout import kv_placement
from kvtier.connector.vllm.metadata import KVTierMetadata
from kvtier.tiers.gpu.placement import KVPlacement

import vllmdaemon
import vllmharness as harness
from tinymodel import BLOCK, HEAD, KV_HEADS
from vllmdaemon import assert_daemon_holds_nothing, daemon_stats
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
daemon = vllmdaemon.daemon
make_engine = harness.make_engine


# ---------------------------------------------------------------- tests


def test_extra_config_is_validated() -> None:
    assert KVTierConfig.from_extra_config({}).store_policy == "on_compute"
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        KVTierConfig.from_extra_config({"endpoint": "unix:/x", "lod_async": True})
    with pytest.raises(ValueError, match="load_async must be bool"):
        KVTierConfig.from_extra_config({"load_async": "yes"})
    with pytest.raises(ValueError, match="store_policy"):
        KVTierConfig.from_extra_config({"store_policy": "sometimes"})


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("kv_layout", ["LBHNC", "BLHNC", "LBNHC"])
def test_prefix_computed_once_then_loaded_bit_exact(make_engine, daemon, load_async, kv_layout):
    first = make_engine(load_async=load_async, kv_layout=kv_layout)
    shared = prompt(1, 5 * BLOCK)
    first.add(shared + prompt(2, 7), "a")
    first.run()
    assert first.stats["stored_blocks"] == 5
    assert_scheduler_empty(first.scheduler)

    # A second engine (its GPU cache empty) gets the prefix from kvtier.
    second = make_engine(load_async=load_async, kv_layout=kv_layout)
    second.add(shared + prompt(3, 9), "b")
    second.run()
    assert second.stats["loaded_blocks"] == 5
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= 5 * BLOCK
    assert second.hit_sources == {CacheHitSource.HOST: 5 * BLOCK}
    assert "deduplicated_blocks" not in second.stats  # its loaded blocks are not stored again
    assert_scheduler_empty(second.scheduler)
    assert_daemon_holds_nothing(second, daemon)


def test_async_load_waits_for_remote_kvs(make_engine) -> None:
    first = make_engine()
    shared = prompt(4, 4 * BLOCK)
    first.add([*shared, 7], "a")
    first.run()
    second = make_engine()
    request = second.add([*shared, 8, 9], "b")
    second.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    second.run()
    assert second.stats["loaded_blocks"] == 4
    assert_scheduler_empty(second.scheduler)


def test_store_policy_on_finish_holds_blocks_until_stored(make_engine, daemon) -> None:
    first = make_engine(store_policy="on_finish")
    shared = prompt(5, 3 * BLOCK)
    first.add([*shared, 5, 6], "a", max_tokens=BLOCK)
    first.run()
    # 3 prompt blocks and the one the decoded tokens filled.
    assert first.stats["stored_blocks"] == 4
    assert_scheduler_empty(first.scheduler)
    second = make_engine(store_policy="on_finish")
    second.add([*shared, 5, 6], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 3
    assert_daemon_holds_nothing(second, daemon)


def test_blocks_already_stored_are_not_copied_again(make_engine) -> None:
    shared = prompt(6, 4 * BLOCK)
    first = make_engine(load_async=False)
    first.add([*shared, 1, 2, 3], "a")
    first.run()
    # Same prefix from a second engine that does not load (its hit is too short to bother).
    second = make_engine(min_hit_blocks=99)
    second.add([*shared, 4], "b")
    second.run()
    assert "loaded_blocks" not in second.stats
    assert second.stats["deduplicated_blocks"] == 4
    assert "stored_blocks" not in second.stats


def test_blocks_pushed_down_to_disk_come_back(make_engine, daemon) -> None:
    first = make_engine(num_blocks=128)
    target = prompt(7, 4 * BLOCK)
    first.add([*target, 1], "target")
    first.run()
    # Fill the 64-slot host tier many times over so the target's blocks leave it.
    for i in range(5):
        first.add([*prompt(100 + i, 20 * BLOCK), 1], f"filler-{i}")
        first.run()
    second = make_engine()
    second.add([*target, 2, 3], "again")
    second.run()
    assert second.stats["loaded_blocks"] == 4
    assert second.hit_sources.get(CacheHitSource.DISK, 0) > 0
    host = {t["tier"]: t for t in daemon_stats(daemon)["tiers"]}["host"]
    assert host["blocks_promoted"] > 0
    assert_scheduler_empty(second.scheduler)


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_daemon_killed_mid_load_means_recompute(make_engine, daemon, load_async) -> None:
    first = make_engine(load_async=load_async)
    shared = prompt(8, 4 * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    second = make_engine(load_async=load_async, timeout_s=0.5)
    second.add([*shared, 2, 3], "b")

    def kill(meta: KVTierMetadata) -> None:
        if meta.loads:
            daemon.kill(signal.SIGKILL)
            second.before_load = None

    second.before_load = kill
    second.run()
    assert second.stats["load_failed_blocks"] == 4
    assert "loaded_blocks" not in second.stats
    # Every token of the prompt was recomputed and read back exact by the fake forward.
    assert second.checked_tokens >= 4 * BLOCK
    assert_scheduler_empty(second.scheduler)


def test_different_cache_salt_gets_no_hit(make_engine) -> None:
    first = make_engine()
    shared = prompt(9, 4 * BLOCK)
    first.add([*shared, 1], "a", cache_salt="tenant-1")
    first.run()
    second = make_engine()
    second.add([*shared, 2], "b", cache_salt="tenant-2")
    second.add([*shared, 3], "c")
    second.run()
    assert "loaded_blocks" not in second.stats
    third = make_engine()
    third.add([*shared, 4], "d", cache_salt="tenant-1")
    third.run()
    assert third.stats["loaded_blocks"] == 4


def test_preemption_leaks_nothing(make_engine, daemon) -> None:
    # 12 blocks cannot hold two requests that each grow to 7 blocks: one is preempted.
    engine = make_engine(num_blocks=13)
    engine.add(prompt(10, 4 * BLOCK), "a", max_tokens=3 * BLOCK)
    engine.add(prompt(11, 4 * BLOCK), "b", max_tokens=3 * BLOCK)
    engine.run()
    assert engine.preemptions > 0
    assert_scheduler_empty(engine.scheduler)
    assert_daemon_holds_nothing(engine, daemon)


def test_abort_mid_load_leaks_nothing(make_engine, daemon) -> None:
    first = make_engine()
    shared = prompt(12, 4 * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    second = make_engine()
    request = second.add([*shared, 2], "b")
    second.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    second.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    second.run()
    assert_scheduler_empty(second.scheduler)
    assert_daemon_holds_nothing(second, daemon)


def test_blocks_move_between_engines_with_different_kv_layouts(make_engine) -> None:
    shared = prompt(13, 3 * BLOCK)
    first = make_engine(kv_layout="BLHNC")
    first.add([*shared, 1], "a")
    first.run()
    second = make_engine(kv_layout="LBNHC")
    second.add([*shared, 2], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 3


def test_vllm_stats_and_metrics_carry_tier_hits(make_engine) -> None:
    shared = prompt(14, 3 * BLOCK)
    first = make_engine()
    first.add([*shared, 1], "a")
    first.run()
    second = make_engine()
    second.add([*shared, 2], "b")
    second.run()
    # Scheduler and worker counters, summed by vLLM into SchedulerStats.kv_connector_stats.
    assert second.scheduler_stats["host_hit_tokens"] == 3 * BLOCK
    assert second.scheduler_stats["lookup_tokens"] >= 3 * BLOCK
    assert second.scheduler_stats["loaded_blocks"] == 3

    registry = prometheus_client.CollectorRegistry()
    counter = functools.partial(prometheus_client.Counter, registry=registry)
    types = {
        prometheus_client.Gauge: prometheus_client.Gauge,
        prometheus_client.Counter: counter,
        prometheus_client.Histogram: prometheus_client.Histogram,
    }
    metrics = KVTierConnector.build_prom_metrics(
        second.vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    metrics.observe(second.scheduler_stats, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    value = registry.get_sample_value("vllm:kvtier_host_hit_tokens_total", labels)
    assert value == 3 * BLOCK


@pytest.mark.parametrize("kv_layout", ["BLHNC", "LBHNC", "LBNHC"])
def test_placement_reads_vllms_own_allocation(make_engine, kv_layout) -> None:
    engine = make_engine(kv_layout=kv_layout)
    (group,) = groups_from_kv_cache_config(engine.kv_cache_config)
    layout, names = group.layout, list(group.layer_names)
    seen = kv_placement(layout, engine.kv_caches, names)
    assert seen.block_contiguous == (kv_layout == "BLHNC")
    # kvtier's own allocation (the reference engine's pool, the GPU bench) is vLLM's, byte
    # for byte: the same strides for the same order.
    made = KVPlacement.allocate(layout, seen.num_blocks, order=kv_layout)
    strides = ("offset", "layer_stride", "block_stride", "head_stride", "token_stride")
    assert [getattr(seen, s) for s in strides] == [getattr(made, s) for s in strides]
    # Block 3's canonical bytes are its [layer][head][token][K V] cells, in that order.
    values = torch.arange(2 * KV_HEADS * BLOCK * 2 * HEAD, dtype=torch.float16)
    for layer, name in enumerate(names):
        cells = values.view(2, KV_HEADS, BLOCK, 2 * HEAD)[layer]
        engine.kv_caches[name][3] = cells
    rows = torch.empty((1, layout.block_bytes), dtype=torch.uint8)
    seen.gather(torch.tensor([3]), rows)
    assert torch.equal(rows.view(torch.float16)[0], values)


def test_stores_start_with_the_next_step(make_engine) -> None:
    engine = make_engine()
    worker = engine.worker.worker
    engine.add([*prompt(15, 3 * BLOCK), 1], "a", max_tokens=4)
    engine.step()  # computes the prompt: its three full blocks are handed over to store
    assert worker.deferred_stores == 1 and worker.in_flight == 0
    assert "stored_blocks" not in engine.stats
    engine.run()
    assert worker.deferred_stores == 0
    assert engine.stats["stored_blocks"] == 3
