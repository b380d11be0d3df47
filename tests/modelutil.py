"""vLLM's real Scheduler over any model's KV cache groups, with KVTierConnector on every
tensor-parallel rank of every pipeline stage and a fake forward that knows each layer's
attention window.

The model is a dict of vLLM per-layer ``KVCacheSpec``s; vLLM's own ``get_kv_cache_groups``
makes its KV cache groups (one per layer kind and repetition, as for gpt-oss or Gemma 3) and
``allocate_kv_cache`` its tensors, in the resolved KV cache layout (kernel blocks included).
Under pipeline parallelism each stage holds the layers vLLM's ``get_pp_indices`` gives it and
its own KV cache config, and the scheduler gets the first stage's, as vLLM's
``generate_scheduler_kv_cache_config`` picks it.

The fake forward writes, for every token it computes and every layer, bytes that depend only
on the token prefix, the layer and the tensor-parallel shard; before it writes, it checks
that every earlier token the layer attends to (all of them for full attention, the last
``W - 1`` for a sliding window of ``W``, those of the current chunk for chunked local
attention) holds exactly its bytes, on every rank. A block loaded from kvtier with one wrong
byte fails that check; a block outside the window is never read, as attention never reads it.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_models.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # (why: vllmharness)

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.utils import get_pp_indices
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import kvtier.connector.vllm.connector as connector_module
from kvtier.connector.vllm.compat import resumed_req_ids
from kvtier.connector.vllm.metadata import KVTierMetadata

import vllmharness as harness
from daemonutil import Daemon

MAX_STEPS = 500
BLOCKS_PER_GROUP = 48


@dataclass(frozen=True)
class Model:
    """A model as vLLM's KV cache manager sees it: each layer's ``KVCacheSpec``."""

    name: str
    layers: dict[str, object]
    tp: int = 1
    pp: int = 1
    kernel_block_size: int | None = None
    """Kernel block size every group's attention reads (None: the cache block)."""
    kv_layout: str = "BLHNC"
    """The KV cache layout vLLM resolves (kvtier asks for BLHNC; backends may not give it)."""

    @property
    def block_size(self) -> int:
        return next(iter(self.layers.values())).block_size

    def stage_layers(self, stage: int) -> dict[str, object]:
        """The layers pipeline ``stage`` holds (consecutive, as vLLM splits decoder layers)."""
        start, end = get_pp_indices(len(self.layers), stage, self.pp)
        return dict(list(self.layers.items())[start:end])


def window_start(spec, position: int) -> int:
    """The first token that the token at ``position`` attends to in a layer of ``spec``."""
    window = getattr(spec, "sliding_window", None)
    if type(spec).__name__.startswith("SlidingWindow") and window is not None:
        return max(0, position - window + 1)
    chunk = getattr(spec, "attention_chunk_size", None)
    if type(spec).__name__ == "ChunkedLocalAttentionSpec":
        return position // chunk * chunk
    return 0


def prefix_bytes(tokens: list[int], layer: int, shard: int, shape: tuple[int, int]) -> torch.Tensor:
    """``[len(tokens), H, C]`` uint8: token p's bytes depend on ``tokens[:p+1]``, the layer
    and the shard only."""
    seeds = np.empty(len(tokens), dtype=np.uint64)
    h = xxhash.xxh64_intdigest(f"{layer}/{shard}".encode())
    for p, token in enumerate(tokens):
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + int(token).to_bytes(4, "little"))
        seeds[p] = h
    width = shape[0] * shape[1]
    idx = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed = (seeds[:, None] ^ idx[None, :]) * np.uint64(0xBF58476D1CE4E5B9)
    # Avoid the bytes of NaNs and infinities of 1-byte floats (0x7F, 0xFF): any other byte
    # is a finite value whose bits survive every copy.
    values = ((mixed >> np.uint64(32)) % np.uint64(127)).astype(np.uint8)
    return torch.from_numpy(values.reshape(len(tokens), *shape))


@dataclass
class Rank:
    """One tensor-parallel rank of one pipeline stage: its worker connector and its KV
    tensors (of its stage's layers)."""

    rank: int
    worker: object
    caches: dict[str, torch.Tensor]
    stage: int = 0


@dataclass
class LoadLog:
    """Blocks planned for loading, by request and KV cache group."""

    blocks: dict[tuple[str, int], int] = field(default_factory=dict)

    def record(self, meta: KVTierMetadata) -> None:
        for load in meta.loads:
            key = (load.req_id, load.group)
            self.blocks[key] = self.blocks.get(key, 0) + len(load.block_ids)


class ModelEngine:
    """vLLM's Scheduler with KVTierConnector on ``model.tp`` ranks and a fake forward."""

    def __init__(
        self,
        daemon: Daemon,
        model_dir: Path,
        model: Model,
        monkeypatch,
        *,
        num_blocks: int | None = None,
        max_batched_tokens: int = 512,
        **extra,
    ):
        extra.setdefault("endpoint", daemon.target)
        extra.setdefault("connect_wait_s", 30.0)
        self.model = model
        self.vllm_config = harness.make_vllm_config(
            model_dir, extra, max_batched_tokens, model.kv_layout
        )
        self.vllm_config.cache_config.block_size = model.block_size
        self.vllm_config.parallel_config.tensor_parallel_size = model.tp
        self.vllm_config.parallel_config.pipeline_parallel_size = model.pp
        stages = [model.stage_layers(stage) for stage in range(model.pp)]
        stage_groups = [get_kv_cache_groups(self.vllm_config, layers) for layers in stages]
        if num_blocks is None:
            # vLLM admits a prompt computed in one step only when every group's blocks for it
            # fit in the one pool the groups share: room for 48 blocks a group.
            num_blocks = BLOCKS_PER_GROUP * len(stage_groups[0])
        configs = []
        for layers, groups in zip(stages, stage_groups, strict=True):
            # Groups overlay one another: a block is as large as the largest group's pages.
            block_bytes = max(
                sum(layers[name].page_size_bytes for name in group.layer_names) for group in groups
            )
            configs.append(
                get_kv_cache_config_from_groups(self.vllm_config, groups, num_blocks * block_bytes)
            )
        self.kv_cache_config = generate_scheduler_kv_cache_config(configs)
        assert self.kv_cache_config.num_blocks == num_blocks
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.group_of = {
            name: g
            for groups in stage_groups
            for g, group in enumerate(groups)
            for name in group.layer_names
        }
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=model.block_size,
        )
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        kernels = None
        if model.kernel_block_size is not None:
            kernels = [model.kernel_block_size] * len(stage_groups[0])
        self.ranks: list[Rank] = []
        for stage, config in enumerate(configs):
            for rank in range(model.tp):
                with monkeypatch.context() as patch:
                    patch.setattr(connector_module, "_tp_rank", lambda rank=rank: rank)
                    patch.setattr(connector_module, "_pp_rank", lambda stage=stage: stage)
                    worker = KVConnectorFactory.create_connector(
                        config=self.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=config
                    )
                caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernels)
                worker.register_kv_caches(caches)
                self.ranks.append(Rank(rank, worker, caches, stage))
        self.aggregator = KVOutputAggregator(expected_finished_count=len(self.ranks))
        self.block_tables: dict[str, list[list[int]]] = {}
        self.checked_tokens = 0
        self.stats: dict[str, int] = {}
        self.scheduler_stats: dict[str, int] = {}
        self.hit_sources: dict[CacheHitSource, int] = {}
        self.loads = LoadLog()
        self.before_load = None

    @property
    def connector(self):
        return self.scheduler.connector

    @property
    def groups(self):
        return self.connector.scheduler.groups

    def add(self, tokens: list[int], req_id: str, max_tokens: int = 3, **kwargs) -> Request:
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.model.block_size, sha256),
            **kwargs,
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> bool:
        self.connector.scheduler.hits.wait_for_lookups(timeout=60)
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.loads.record(meta)
        for r in self.ranks:
            r.worker.bind_connector_metadata(meta)
            r.worker.handle_preemptions(meta)
        if self.before_load is not None:
            self.before_load(meta)
        if out.has_sync_kv_loads:
            for r in self.ranks:
                r.worker.start_load_kv(None)
        spoiled: set[int] = set()
        for r in self.ranks:
            spoiled |= r.worker.get_block_ids_with_load_errors()
        sampled = self._forward(out, spoiled)
        outputs = []
        for r in self.ranks:
            if not out.has_sync_kv_loads:
                r.worker.start_load_kv(None)
            r.worker.wait_for_save()
            results = r.worker.get_transfer_results(out.finished_req_ids)
            stats = r.worker.get_kv_connector_stats()
            if stats is not None:
                for key, value in stats.data.items():
                    self.stats[key] = self.stats.get(key, 0) + value
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=spoiled | r.worker.get_block_ids_with_load_errors(),
            )
            r.worker.clear_connector_metadata()
            outputs.append(harness.runner_output(sampled, kv_output))
        engine_outputs = self.scheduler.update_from_output(out, self.aggregator.aggregate(outputs))
        for sched_stats in (o.scheduler_stats for o in engine_outputs.values()):
            if sched_stats is None:
                continue
            if sched_stats.connector_prefix_cache_stats is not None:
                for source, n in sched_stats.connector_prefix_cache_stats.hits_by_source.items():
                    self.hit_sources[source] = self.hit_sources.get(source, 0) + n
            for key, value in (sched_stats.kv_connector_stats or {}).items():
                self.scheduler_stats[key] = self.scheduler_stats.get(key, 0) + value
        return out.total_num_scheduled_tokens > 0

    def _forward(self, out, spoiled: set[int]) -> dict[str, list[int]]:
        """Checks what every scheduled token attends to, writes its KV, samples."""
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = [list(new.block_ids[g]) for g in range(num_groups)]
        cached = out.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in resumed:
                self.block_tables[req_id] = [list(ids[g]) if ids else [] for g in range(num_groups)]
            elif ids:
                for g in range(num_groups):
                    self.block_tables[req_id][g].extend(ids[g])
        computed = harness.computed_tokens(out)
        sampled: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start, end = computed[req_id], computed[req_id] + num
            tables = self.block_tables[req_id]
            if spoiled.intersection(b for table in tables for b in table):
                sampled[req_id] = []  # it read a failed load: vLLM recomputes it
                continue
            tokens = list(request.all_token_ids)[:end]
            for r in self.ranks:
                self._forward_rank(r, req_id, tokens, start, tables)
            self.checked_tokens += start
            done = end >= request.num_tokens
            sampled[req_id] = [(sum(tokens) + end) % 997 + 3] if done else []
        return sampled

    def _forward_rank(self, r: Rank, req_id: str, tokens, start: int, tables) -> None:
        end = len(tokens)
        block = self.model.block_size
        for layer, (name, spec) in enumerate(self.model.layers.items()):
            if name not in r.caches:
                continue  # another pipeline stage's layer
            group = self.groups[self.group_of[name]]
            cache = r.caches[name]
            kernel = cache.shape[2]  # tokens per kernel block
            split = block // kernel
            pages = cache.view(torch.uint8)  # [B * split, H, kernel, C bytes]
            values = prefix_bytes(tokens, layer, group.shard(r.rank), pages.shape[1::2])
            table = torch.tensor(tables[self.group_of[name]], dtype=torch.long)
            first = window_start(spec, start)
            positions = torch.arange(first, end)
            kernels = table[positions // block] * split + positions % block // kernel
            offsets = positions % kernel
            seen = start - first
            got = pages[kernels[:seen], :, offsets[:seen], :]
            assert torch.equal(got, values[first:start]), (
                f"{req_id}: rank {r.rank} {name} tokens {first}..{start} differ"
            )
            pages[kernels[seen:], :, offsets[seen:], :] = values[start:end]

    def run(self) -> int:
        steps = 0
        while self.scheduler.has_requests():
            assert steps < MAX_STEPS, "the scheduler never drained"
            if not self.step():
                # Nothing to compute: every request waits for a load or holds blocks for a
                # store. Let those land rather than spin, so the number of steps does not
                # depend on how fast the helper threads run.
                for r in self.ranks:
                    r.worker.worker.wait_for_loads(timeout=60)
                    r.worker.worker.drain()
            steps += 1
        self.settle()
        return steps

    def settle(self) -> None:
        """Lets every store commit and counts it."""
        for r in self.ranks:
            r.worker.worker.drain()
            stats = r.worker.get_kv_connector_stats()
            if stats is not None:
                for key, value in stats.data.items():
                    self.stats[key] = self.stats.get(key, 0) + value

    def close(self) -> None:
        for r in self.ranks:
            r.worker.shutdown()
        self.connector.shutdown()
