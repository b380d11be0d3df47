"""The scheduler half of ``KVTierConnector``: lookups, load plans and store plans.

Per request it keeps kvtier's hash chain (every TP rank's), the request's vLLM block ids and
how many of its blocks have been handed to the workers to store. Each step:

* ``get_num_new_matched_tokens`` hashes the prompt's full blocks and asks the daemon, in ONE
  batched ``Lookup``, how many of those beyond vLLM's own GPU hit it holds (never the block
  of the last prompt token). It changes nothing but a cache of that answer.
* ``update_state_after_alloc`` turns an accepted hit into a load of those hashes into the
  blocks vLLM just allocated.
* ``build_connector_meta`` emits the step's loads, and stores of the blocks this step fills
  (``on_compute``) or of finished requests (``on_finish``).
* ``request_finished`` keeps a request's blocks while a store may still read them; a worker
  reports it in ``finished_sending`` once every such copy has landed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvtier.connector.vllm_config import KVTierConfig
from kvtier.connector.vllm_metadata import KVTierMetadata, LoadSpec, StoreSpec
from kvtier.connector.vllm_request import RequestHashes
from kvtier.connector.vllm_stats import KVTierStats
from kvtier.tiers.hashing import Namespace
from kvtier.tiers.host import LowerHits
from kvtier.tiers.layout import KVLayout

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    """What the scheduler side remembers of one request."""

    request: object
    hashes: RequestHashes
    block_ids: list[int] = field(default_factory=list)
    stored_blocks: int = 0
    """Leading blocks already in kvtier or handed to the workers to store."""
    lookup_at: int = -1
    """``num_computed_tokens`` of this step's lookup (-1: none yet this step)."""
    hit_start: int = 0
    """First block of the last lookup; ``lookup`` is its answer."""
    lookup: LowerHits = field(default_factory=LowerHits)
    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    stores_issued: bool = False


class SchedulerSide:
    """Plans kvtier loads and stores for vLLM's scheduler."""

    def __init__(self, config: KVTierConfig, layout: KVLayout, model_id: str, tp_world: int):
        self.config = config
        self.block_size = layout.block_size
        self.namespaces = [
            Namespace(model_id, layout.signature, rank, tp_world) for rank in range(tp_world)
        ]
        self.client = config.client(layout, "vllm-scheduler", map_arena=False)
        if config.connect_wait_s and not self.client.wait_connected(config.connect_wait_s):
            log.warning(
                "kvtier daemon %s not reachable yet; lookups miss until it is", config.target()
            )
        self.stats = KVTierStats()
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._stores: list[StoreSpec] = []
        self._hold_new: set[str] = set()
        self._held: set[str] = set()
        self._looked_up: set[str] = set()
        self._failures_seen = 0

    def close(self) -> None:
        self.client.close()

    # ---- requests ----

    def _state(self, request) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            hashes = RequestHashes(request, self.namespaces, self.block_size)
            state = _Request(request, hashes)
            self._requests[request.request_id] = state
        return state

    def on_new_request(self, request) -> None:
        self._state(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether async."""
        if request.prompt_embeds is not None:
            return 0, False  # token ids do not name embeddings
        state = self._state(request)
        start = num_computed_tokens // self.block_size
        # Never the block holding the last token: vLLM needs one real forward for logits.
        end = state.hashes.extend_to(
            request.all_token_ids, (request.num_tokens - 1) // self.block_size
        )
        if end - start < self.config.min_hit_blocks:
            return 0, False
        if state.lookup_at != num_computed_tokens:
            state.lookup = self.client.lookup(state.hashes.rank0(start, end))
            state.lookup_at = num_computed_tokens
            state.hit_start = start
            self._looked_up.add(request.request_id)
            self.stats.add("lookup_tokens", (end - start) * self.block_size)
        hit = state.lookup.total
        if hit < self.config.min_hit_blocks:
            return 0, False
        return hit * self.block_size, self.config.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plans the load of an accepted hit into the blocks vLLM allocated for it."""
        if num_external_tokens == 0:
            return
        state = self._requests[request.request_id]
        start = state.hit_start
        num = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        self._loads.append(
            LoadSpec(
                req_id=request.request_id,
                block_ids=list(block_ids[start : start + num]),
                hashes=state.hashes.packed(start, start + num),
                sync=not self.config.load_async,
            )
        )
        state.host_hit_blocks = min(state.lookup.host, num)
        state.disk_hit_blocks = num - state.host_hit_blocks
        self.stats.add("host_hit_tokens", state.host_hit_blocks * self.block_size)
        self.stats.add("disk_hit_tokens", state.disk_hit_blocks * self.block_size)

    def hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` split by the tier that holds them."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return {}
        split = {
            CacheHitSource.HOST: state.host_hit_blocks * self.block_size,
            CacheHitSource.DISK: state.disk_hit_blocks * self.block_size,
        }
        if sum(split.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {source: n for source, n in split.items() if n}

    # ---- steps ----

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        """This step's loads and stores; clears what it hands out."""
        meta = KVTierMetadata(loads=self._loads, stores=self._stores, hold=self._hold_new)
        self._loads, self._stores, self._hold_new = [], [], set()
        # A lookup answers for the step it was made in; the next step asks the daemon again.
        for req_id in self._looked_up:
            state = self._requests.get(req_id)
            if state is not None:
                state.lookup_at = -1
        self._looked_up.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests[new.req_id]
            state.block_ids = list(new.block_ids[0])
            # Below num_computed_tokens lie GPU hits (stored by whoever computed them) and
            # kvtier loads; everything from there on is computed, so stored, from now on.
            state.stored_blocks = new.num_computed_tokens // self.block_size
            self._plan_compute_store(meta, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            end = cached.num_computed_tokens[i] + scheduled[req_id]
            self._plan_compute_store(meta, state, end)
        for req_id in scheduler_output.preempted_req_ids or ():
            meta.preempted.add(req_id)
            self._requests[req_id].block_ids = []
        return meta

    def _plan_compute_store(self, meta: KVTierMetadata, state: _Request, end: int) -> None:
        if self.config.store_policy != "on_compute":
            return
        spec = self._store_spec(state, end // self.block_size)
        if spec is not None:
            meta.stores.append(spec)

    def _store_spec(self, state: _Request, full_blocks: int) -> StoreSpec | None:
        """A store of blocks ``[stored_blocks, full_blocks)`` whose ids and tokens are known."""
        request = state.request
        full_blocks = min(full_blocks, len(state.block_ids))
        end = min(state.hashes.extend_to(request.all_token_ids, full_blocks), full_blocks)
        start = state.stored_blocks
        if end <= start:
            return None
        state.stored_blocks = end
        state.stores_issued = True
        return StoreSpec(
            req_id=request.request_id,
            block_ids=state.block_ids[start:end],
            hashes=state.hashes.packed(start, end),
            parents=state.hashes.packed_parents(start, end),
        )

    def request_finished(self, request, block_ids: list[int]) -> bool:
        """True if vLLM must keep the request's blocks until a worker reports it sent."""
        state = self._requests.pop(request.request_id, None)
        if state is None or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Its load has not finished: vLLM frees the blocks on finished_recving, and
            # nothing of it was computed, so nothing was stored.
            return False
        if self.config.store_policy == "on_finish":
            state.block_ids = list(block_ids)
            spec = self._store_spec(state, request.num_computed_tokens // self.block_size)
            if spec is not None:
                self._stores.append(spec)
        if not state.stores_issued:
            return False
        self._hold_new.add(request.request_id)
        self._held.add(request.request_id)
        return True

    def has_pending_work(self) -> bool:
        """Blocks are held for stores still in flight: the engine must keep stepping."""
        return bool(self._held)

    def update_connector_output(self, output) -> None:
        for req_id in output.finished_sending or ():
            self._held.discard(req_id)

    def take_stats(self) -> KVTierStats | None:
        failures = self.client.failures
        self.stats.add("daemon_failures", failures - self._failures_seen)
        self._failures_seen = failures
        return self.stats.take()
