"""``KVTierConnector``: vLLM's prefix walk falls through to kvtier.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "unix:///run/kvtier/kvtier.sock"}}'

vLLM builds the class once per role. The scheduler role (``scheduler.SchedulerSide``)
looks up hashes and plans loads and stores; the worker role (``worker.WorkerSide``)
copies blocks. This module only routes vLLM's calls to the side that serves them; the keys of
``kv_connector_extra_config`` are in ``config.KVTierConfig``. It supports vLLM's hybrid
KV cache manager (``SupportsHMA``): each KV cache group is stored and loaded on its own
(``groups``), and pipeline parallelism: each stage stores and loads its own layers. Blocks
are named by the model's name and fingerprint (``identity``). With vLLM's
``--kv-events-config`` the scheduler role also publishes what the daemon's host and disk tiers
hold, in vLLM's KV events (``events``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.utils import get_pp_indices
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.vllm.compat import DRIFT_ERRORS, missing_for_loads
from kvtier.connector.vllm.config import KVTierConfig, check_load_failure_policy
from kvtier.connector.vllm.groups import NO_PIPELINE, Pipeline, groups_from_kv_cache_config
from kvtier.connector.vllm.identity import model_identity
from kvtier.connector.vllm.layout import REQUIRED_KV_CACHE_LAYOUT
from kvtier.connector.vllm.metadata import KVTierMetadata
from kvtier.connector.vllm.scheduler import SchedulerSide
from kvtier.connector.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.connector.vllm.worker import WorkerSide

__all__ = ["KVTierConnector"]

log = logging.getLogger(__name__)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's host and disk tiers behind vLLM's GPU prefix cache."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        check_load_failure_policy(self._kv_transfer_config)
        config = KVTierConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        tp_world = parallel.tensor_parallel_size
        # vLLM hands the scheduler the first pipeline stage's KV cache config.
        stage = _pp_rank() if role == KVConnectorRole.WORKER else 0
        groups = groups_from_kv_cache_config(
            kv_cache_config,
            tp_world,
            getattr(parallel, "decode_context_parallel_size", 1),
            getattr(parallel, "prefill_context_parallel_size", 1),
            pipeline_of(vllm_config, stage),
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._shut_down = False
        # vLLM gives every engine an id its scheduler and workers share: the worker's acquire
        # takes over the host hits the scheduler's lookup held
        group = self._kv_transfer_config.engine_id or ""
        if role == KVConnectorRole.SCHEDULER:
            hash_block_size = kv_cache_config.hash_block_size  # None: vLLM's block size
            events = vllm_config.kv_events_config
            self._scheduler = SchedulerSide(
                config,
                groups,
                model_identity(vllm_config, config.model_id),
                hash_block_size,
                engine_group=group,
                publish_events=bool(events and events.enable_kv_cache_events),
            )
            gap = missing_for_loads()
            if gap is not None:
                self._scheduler.drift.seen("update_state_after_alloc", gap, lost_track=True)
        else:
            self._worker = WorkerSide(config, groups, _tp_rank(), engine_group=group)
        log.info(
            "KVTierConnector (%s): daemon %s, %s, store %s, %s loads",
            role.name,
            config.target(),
            "; ".join(f"group {g.index} {g.kind}: {g.layout.describe()}" for g in groups),
            config.store_policy,
            "async" if config.load_async else "sync",
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped by a preemption is a later miss, nothing more.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        model = vllm_config.model_config
        if model is not None and model.use_mla and current_platform.is_cpu():
            # vLLM's CPU MLA backends (the reference one and the AMX one) declare no layouts,
            # so vLLM would take ours, but address a layer's cache as one run of rows (through
            # `.view(-1, latent)`, or row `block * block_size + offset` in the AMX kernels),
            # which a block-outermost layout's strided per-layer view breaks: leave it vLLM's
            # default, layer by layer.
            return None
        return REQUIRED_KV_CACHE_LAYOUT

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Closes this side once; a later call does nothing (its executors are gone)."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        side = self._scheduler or self._worker
        return side.take_stats()

    # ---- worker side ----

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.worker.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTierMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: sync loads already ordered the compute stream after them."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are stored at ``wait_for_save``."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.worker.get_finished(finished_req_ids)
        failed = self.worker.take_failed_loads()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    # ---- scheduler side ----

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    # Whatever a newer vLLM changed in the objects these read costs hits, never vLLM's step
    # (``compat.VllmDrift``): each catches what reading a changed object raises.

    def on_new_request(self, request) -> None:
        try:
            self.scheduler.hits.on_new_request(request)
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("on_new_request", error)

    def may_load_async(self, request) -> bool:
        try:
            return self.scheduler.hits.may_load_async(request)
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("may_load_async", error)
            return False

    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            return self.scheduler.hits.get_num_new_matched_tokens(request, num_computed_tokens)
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("get_num_new_matched_tokens", error)
            return 0, False

    def get_external_cache_hit_sources(
        self, request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        try:
            return self.scheduler.hits.hit_sources(request, num_external_tokens)
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("get_external_cache_hit_sources", error)
            return {}

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        try:
            self.scheduler.hits.update_state_after_alloc(request, blocks, num_external_tokens)
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("update_state_after_alloc", error, lost_track=True)

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        try:
            self.scheduler.update_connector_output(connector_output)
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("update_connector_output", error, lost_track=True)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        try:
            return self.scheduler.request_finished(request, list(block_ids)), None
        except DRIFT_ERRORS as error:
            self.scheduler.drift.seen("request_finished", error, lost_track=True)
            return False, None

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def take_events(self):
        return self.scheduler.take_events()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM runs without distributed groups)."""
    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


def _pp_rank() -> int:
    """This worker's pipeline stage (0 when vLLM runs without distributed groups)."""
    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_pp_group().rank_in_group


def pipeline_of(vllm_config, stage: int) -> Pipeline:
    """Every pipeline stage's decoder layers, as vLLM splits them (``get_pp_indices``, which
    follows ``VLLM_PP_LAYER_PARTITION``), with ``stage`` as this process's."""
    size = vllm_config.parallel_config.pipeline_parallel_size
    if size == 1:
        return NO_PIPELINE
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    spans = [get_pp_indices(layers, s, size) for s in range(size)]
    return Pipeline(tuple((start, end - start) for start, end in spans), stage)
