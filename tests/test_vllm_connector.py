"""KVTierConnector under real vLLM 0.33.0: its Scheduler, its KV tensors, a real daemon.

The scheduler role is built by vLLM's own ``Scheduler``; the worker role drives KV tensors made
by vLLM's ``allocate_kv_cache``. A fake model runner stands in for the forward pass: it writes,
for every token it computes, values that depend only on the token prefix, and before writing
it checks that every earlier token of the request holds exactly its values, which is what
attention would read. A block loaded from kvtier with one wrong byte fails that check.

Run in a venv with vLLM (see README): ``VLLM_TARGET_DEVICE=cpu pytest -m vllm``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import prometheus_client
import pytest
import xxhash

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.connector.vllm.config import KVTierConfig
from kvtier.connector.vllm.connector import KVTierConnector
from kvtier.connector.vllm.groups import groups_from_kv_cache_config
from kvtier.connector.vllm.layout import kv_placement
from kvtier.connector.vllm.metadata import KVTierMetadata
from kvtier.tiers.gpu.placement import KVPlacement

from daemonutil import Daemon

pytestmark = pytest.mark.vllm

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS, HEAD = 2, 16
BLOCK_BYTES = len(LAYERS) * 2 * BLOCK * KV_HEADS * HEAD * 2  # fp16, K and V
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": len(LAYERS),
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MAX_STEPS = 500


# ---------------------------------------------------------------- known KV values


def prefix_values(tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), layers, heads, 2*head]`` fp16: token p's KV depends on tokens[:p+1]."""
    seeds = np.empty(len(tokens), dtype=np.uint64)
    h = 0
    for p, token in enumerate(tokens):
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + int(token).to_bytes(4, "little"))
        seeds[p] = h
    width = len(LAYERS) * KV_HEADS * 2 * HEAD
    idx = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed = (seeds[:, None] ^ idx[None, :]) * np.uint64(0xBF58476D1CE4E5B9)
    ints = (mixed >> np.uint64(40)) % np.uint64(2049)
    values = ints.astype(np.int64) - 1024  # every integer in [-1024, 1024] is exact in fp16
    shaped = values.reshape(len(tokens), len(LAYERS), KV_HEADS, 2 * HEAD)
    return torch.from_numpy(shaped).to(torch.float16)


# ---------------------------------------------------------------- the engine


class Engine:
    """vLLM's Scheduler with both roles of KVTierConnector and a fake model runner."""

    def __init__(
        self,
        daemon: Daemon,
        model_dir: Path,
        *,
        num_blocks: int = 64,
        kv_layout: str = "LBHNC",
        max_batched_tokens: int = 256,
        **extra,
    ):
        extra.setdefault("endpoint", daemon.target)
        extra.setdefault("connect_wait_s", 30.0)
        self.vllm_config = make_vllm_config(model_dir, extra, max_batched_tokens, kv_layout)
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16
        )
        groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.vllm_config, groups, num_blocks * BLOCK_BYTES
        )
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
        )
        self.worker = KVConnectorFactory.create_connector(
            config=self.vllm_config,
            role=KVConnectorRole.WORKER,
            kv_cache_config=self.kv_cache_config,
        )
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv_caches)
        self.block_tables: dict[str, list[int]] = {}
        self.checked_tokens = 0
        self.stats: dict[str, int] = {}
        self.hit_sources: dict[CacheHitSource, int] = {}
        self.scheduler_stats: dict[str, int] = {}
        self.before_load: Callable[[KVTierMetadata], None] | None = None
        self.preemptions = 0

    @property
    def connector(self) -> KVTierConnector:
        return self.scheduler.connector

    def add(self, tokens: list[int], req_id: str, max_tokens: int = 3, **kwargs) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            **kwargs,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, wait_for_lookups: bool = True) -> bool:
        """One scheduler step and a fake forward pass; True if any token was scheduled.

        It first lets the daemon answer the connector's lookups in flight, so that the steps
        a test takes do not depend on how fast the daemon answers; ``wait_for_lookups=False``
        steps as vLLM does, never waiting.
        """
        if wait_for_lookups:
            self.connector.scheduler.hits.wait_for_lookups(timeout=60)
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions(meta)
        self.preemptions += len(out.preempted_req_ids or ())
        if self.before_load is not None:
            self.before_load(meta)
        load_errors: set[int] = set()
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
            load_errors = worker.get_block_ids_with_load_errors()
        sampled = self._forward(out, load_errors)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        stats = self._take_stats()
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=load_errors | worker.get_block_ids_with_load_errors(),
            kv_connector_stats=stats,
        )
        worker.clear_connector_metadata()
        req_ids = list(sampled)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_output,
        )
        outputs = self.scheduler.update_from_output(out, runner_output)
        for engine_outputs in outputs.values():
            sched_stats = engine_outputs.scheduler_stats
            if sched_stats is None:
                continue
            if sched_stats.connector_prefix_cache_stats is not None:
                hits = sched_stats.connector_prefix_cache_stats.hits_by_source
                for source, n in hits.items():
                    self.hit_sources[source] = self.hit_sources.get(source, 0) + n
            for key, value in (sched_stats.kv_connector_stats or {}).items():
                self.scheduler_stats[key] = self.scheduler_stats.get(key, 0) + value
        return out.total_num_scheduled_tokens > 0

    def _take_stats(self):
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            for key, value in stats.data.items():
                self.stats[key] = self.stats.get(key, 0) + value
        return stats

    def _forward(self, out, load_errors: set[int]) -> dict[str, list[int]]:
        """Checks every earlier token's KV, writes the scheduled tokens' KV, samples.

        A request whose sync load failed this step reads garbage, like a real forward would:
        it is neither checked nor written, and vLLM must recompute it.
        """
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.block_tables[req_id] = list(ids[0]) if ids else []
            elif ids:
                self.block_tables[req_id].extend(ids[0])
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = computed[req_id]
            end = start + num
            tokens = list(request.all_token_ids)
            values = prefix_values(tokens[:end])
            if load_errors.intersection(self.block_tables[req_id]):
                sampled[req_id] = []
                continue
            table = torch.tensor(self.block_tables[req_id], dtype=torch.long)
            positions = torch.arange(end)
            blocks, offsets = table[positions // BLOCK], positions % BLOCK
            for layer, name in enumerate(LAYERS):
                cache = self.kv_caches[name]
                seen = cache[blocks[:start], :, offsets[:start], :]
                assert torch.equal(seen, values[:start, layer]), (
                    f"{req_id}: KV of tokens < {start} differs in layer {layer}"
                )
                cache[blocks[start:], :, offsets[start:], :] = values[start:, layer]
            self.checked_tokens += start
            if end >= request.num_tokens:
                sampled[req_id] = [(sum(tokens) + end) % 997 + 3]
            else:
                sampled[req_id] = []
        return sampled

    def run(self) -> int:
        """Steps until the scheduler has nothing left; returns the steps taken."""
        steps = 0
        while self.scheduler.has_requests():
            assert steps < MAX_STEPS, "the scheduler never drained"
            if not self.step():
                # Every request waits for an async load: let the loads land rather than spin,
                # so the number of steps does not depend on how fast the acquire thread runs.
                self.worker.worker.wait_for_loads(timeout=60)
            steps += 1
        self.worker.worker.drain()  # commits answered after the last step count too
        self._take_stats()
        return steps

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def make_vllm_config(model_dir: Path, extra: dict, max_batched_tokens: int, layout: str):
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=4096
    )
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    # vLLM resolves the layout (asking the connector) before it builds connectors.
    cache.kv_cache_layout = layout
    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.connector.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, block or transfer state left behind (as vLLM's own tests check)."""
    assert not scheduler.requests
    assert not scheduler.waiting
    assert not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    manager = scheduler.kv_cache_manager
    assert not manager.coordinator.single_type_managers[0].req_to_blocks
    pool = manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 990, num_tokens)]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, scope="module")
def _none_hash() -> None:
    init_none_hash(sha256)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return tmp_path


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES, disk_bytes=1024 * BLOCK_BYTES)
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def make_engine(daemon: Daemon, model_dir: Path):
    engines: list[Engine] = []

    def make(**kwargs) -> Engine:
        engine = Engine(kwargs.pop("daemon", daemon), model_dir, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def daemon_stats(daemon: Daemon) -> dict:
    """The daemon's ``/stats`` JSON (every counter, per tier, and the slots sessions hold)."""
    url = f"http://127.0.0.1:{daemon.stats_port}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def assert_daemon_holds_nothing(engine: Engine, daemon: Daemon) -> None:
    engine.worker.worker.drain()
    stats = daemon_stats(daemon)
    assert stats["sessions"] >= 1  # our sessions are alive: the slots were handed back
    assert stats["reserved_slots"] == 0
    assert stats["acquired_slots"] == 0


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
