"""The harness of the vLLM connector's tests: KVTierConnector under real vLLM (0.33.0 or
0.34.0), its Scheduler, its KV tensors, a real daemon.

``Engine`` builds the scheduler role with vLLM's own ``Scheduler`` and drives the worker role on
KV tensors made by vLLM's ``allocate_kv_cache``. A fake model runner stands in for the forward
pass: it writes, for every token it computes, values that depend only on the token prefix, and
before writing it checks that every earlier token of the request holds exactly its values, which
is what attention would read (``tinymodel``). A block loaded from kvtier with one wrong byte
fails that check.

A test module takes the fixtures it uses by name (``model_dir = harness.model_dir``; the
daemon's is in ``vllmdaemon``), as pytest finds fixtures only in test modules and conftests.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM 0.34's x86 CPU platform refuses a config unless Triton is usable, for its CPU model
# runner's kernels. These tests build vLLM's scheduler and KV cache config, never a model
# runner nor a kernel, from vLLM's CUDA build on a machine with no GPU: CUDA's own
# "no device visible" (an empty CUDA_VISIBLE_DEVICES, true of this process) is what vLLM reads
# as "Triton's GPU driver comes later", and keeps the Triton it ships with importable. A test
# that ran a Triton kernel would fail at once, never run on the wrong device.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
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
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.connector.vllm.compat import resumed_req_ids
from kvtier.connector.vllm.connector import KVTierConnector
from kvtier.connector.vllm.metadata import KVTierMetadata

from daemonutil import Daemon
from tinymodel import BLOCK, BLOCK_BYTES, HEAD, KV_HEADS, LAYERS, TINY_LLAMA, check_then_write

MAX_STEPS = 500


def computed_tokens(out) -> dict[str, int]:
    """Tokens each request of the scheduler's output ``out`` had computed before this step."""
    computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return computed


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
        scheduler: dict | None = None,
        **extra,
    ):
        """``scheduler``: vLLM's ``SchedulerConfig`` fields beyond the harness's; ``extra``:
        ``kv_connector_extra_config``."""
        extra.setdefault("endpoint", daemon.target)
        extra.setdefault("connect_wait_s", 30.0)
        self.vllm_config = make_vllm_config(
            model_dir, extra, max_batched_tokens, kv_layout, scheduler
        )
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
        outputs = self.scheduler.update_from_output(out, runner_output(sampled, kv_output))
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
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in resumed:
                self.block_tables[req_id] = list(ids[0]) if ids else []
            elif ids:
                self.block_tables[req_id].extend(ids[0])
        computed = computed_tokens(out)
        sampled: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = computed[req_id]
            end = start + num
            tokens = list(request.all_token_ids)
            if load_errors.intersection(self.block_tables[req_id]):
                sampled[req_id] = []
                continue
            check_then_write(self.kv_caches, self.block_tables[req_id], start, tokens[:end], req_id)
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


def make_vllm_config(
    model_dir: Path,
    extra: dict,
    max_batched_tokens: int,
    layout: str,
    scheduler_kw: dict | None = None,
):
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=4096
    )
    scheduler = SchedulerConfig(
        **{
            "max_num_seqs": 16,
            "max_num_batched_tokens": max_batched_tokens,
            "max_model_len": 4096,
            "enable_chunked_prefill": True,
            "is_encoder_decoder": False,
            **(scheduler_kw or {}),
        }
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


def runner_output(sampled: dict[str, list[int]], kv_output: KVConnectorOutput) -> ModelRunnerOutput:
    """What vLLM's model runner returns for a step: each request's sampled tokens, in the
    order given, and the connector's output."""
    req_ids = list(sampled)
    # vLLM 0.34 dropped req_id_to_index (the order of req_ids is the index).
    index = (
        {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        else {}
    )
    return ModelRunnerOutput(
        req_ids=req_ids,
        **index,
        sampled_token_ids=[sampled[r] for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_output,
    )


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, scope="module")
def _none_hash() -> None:
    init_none_hash(sha256)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return tmp_path


def closing_each(build: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """An engine fixture's body (``yield from closing_each(build)``): yields a function that
    builds an engine as ``build`` does, and closes every engine it built once the test is over."""
    engines = []

    def make(*args, **kwargs):
        engines.append(build(*args, **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def make_engine(daemon: Daemon, model_dir: Path):
    yield from closing_each(
        lambda **kwargs: Engine(kwargs.pop("daemon", daemon), model_dir, **kwargs)
    )


# ---------------------------------------------------------------- shared by the scheduler's tests


def settle(engine: Engine) -> None:
    """Lets the engine's stores commit and counts them in ``engine.stats``."""
    engine.worker.worker.drain()
    engine._take_stats()


def all_tokens(request: Request) -> list[int]:
    return list(request.all_token_ids)


def kv_cache_config(vllm_config):
    """vLLM's KV cache config for the harness's layers, 16 blocks of them."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16
    )
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    return get_kv_cache_config_from_groups(vllm_config, groups, 16 * BLOCK_BYTES)
