"""The scheduler half of ``KVTierConnector``: lookups, load plans and store plans.

Per request it keeps kvtier's hash chain (every TP rank's), the request's vLLM block ids and
how many of its blocks are in kvtier or handed to the workers to store. Each step:

* ``get_num_new_matched_tokens`` asks the daemon, for every rank and without waiting, how many
  of the prompt's full blocks beyond vLLM's own GPU hit it holds (never the block of the last
  prompt token); the hit is what every rank holds. Until the answer is in it returns
  ``None`` and vLLM asks again next step; the answer is kept until the question changes.
* ``update_state_after_alloc`` turns an accepted hit into a load of those hashes into the
  blocks vLLM just allocated.
* ``build_connector_meta`` emits the step's loads, and stores of the blocks this step fills
  (``on_compute``) or of finished requests (``on_finish``).
* ``update_connector_output`` learns which loads failed (``invalid_block_ids``, from any
  rank) and which async loads landed, and rewinds what it counted as stored.
* ``request_finished`` keeps a request's blocks while a store may still read them; a worker
  reports it in ``finished_sending`` once every such copy has landed.

Blocks computed in the step of a sync load may have read a failed load's garbage (a failure
on any rank spoils every rank's forward), so they are stored only once vLLM has processed
that step's output without a load error.
"""

from __future__ import annotations

import logging
import os

import xxhash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.vllm_config import KVTierConfig
from kvtier.connector.vllm_lookup import Lookup, Lookups
from kvtier.connector.vllm_metadata import KVTierMetadata, LoadSpec, StoreSpec
from kvtier.connector.vllm_request import PlannedLoad, RequestHashes, RequestState
from kvtier.connector.vllm_stats import KVTierStats
from kvtier.tiers.hashing import BlockHash, Namespace
from kvtier.tiers.layout import KVLayout

log = logging.getLogger(__name__)


class SchedulerSide:
    """Plans kvtier loads and stores for vLLM's scheduler."""

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout,
        model_id: str,
        tp_world: int,
        hash_block_size: int | None = None,
        engine_group: str = "",
    ):
        self.config = config
        self.block_size = layout.block_size
        if hash_block_size and self.block_size % hash_block_size:
            raise ValueError(
                f"vLLM hashes blocks of {hash_block_size} tokens, which does not divide "
                f"kvtier's block of {self.block_size}"
            )
        self.hash_block_size = hash_block_size
        namespaces = [
            Namespace(model_id, layout.signature, rank, tp_world) for rank in range(tp_world)
        ]
        self._base_seeds = [ns.seed for ns in namespaces]
        self._seeds: list[BlockHash] = list(self._base_seeds)
        self.client = config.client(
            layout, "vllm-scheduler", map_arena=False, engine_group=engine_group
        )
        if config.connect_wait_s and not self.client.wait_connected(config.connect_wait_s):
            log.warning(
                "kvtier daemon %s not reachable yet; lookups miss until it is", config.target()
            )
        self.stats = KVTierStats()
        self._requests: dict[str, RequestState] = {}
        self._loading: dict[str, RequestState] = {}
        self._lookups = Lookups()
        self._loads: list[LoadSpec] = []
        self._stores: list[StoreSpec] = []
        self._hold_new: set[str] = set()
        self._held: set[str] = set()
        self._failures_seen = 0

    def close(self) -> None:
        self.client.close()

    # ---- requests and lookups ----

    def _state(self, request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            hashes = RequestHashes(request, self._seeds, self.block_size, self.hash_block_size)
            state = RequestState(request, hashes)
            self._requests[request.request_id] = state
        return state

    def _hash(self, state: RequestState, num_blocks: int) -> int:
        """Hashes up to ``num_blocks``; whatever vLLM took back is no longer stored or asked."""
        end = state.hashes.extend_to(state.request, num_blocks)
        cut = state.hashes.take_cut()
        if cut is not None:
            state.stored_blocks = min(state.stored_blocks, cut)
            self._lookups.discard(state.lookup)
            state.lookup = None
        return end

    def _lookup(self, state: RequestState, start: int, end: int) -> Lookup:
        """The lookup of blocks ``[start, end)``: the one asked before, or a new one."""
        lookup = state.lookup
        if (
            lookup is None
            or (lookup.start, lookup.end) != (start, end)
            or lookup.stale(self.client.lookup_hold_s)
        ):
            self._lookups.discard(lookup)
            lookup = Lookup.ask(self.client, state.hashes.per_rank(start, end), start, end)
            self._lookups.add(lookup)
            state.lookup = lookup
            self.stats.add("lookup_tokens", (end - start) * self.block_size)
        return lookup

    def on_new_request(self, request) -> None:
        """Asks about the whole prompt at once, so the answer is in when vLLM asks (its own GPU
        hit then being 0, which a prompt that reaches kvtier usually has)."""
        state = self._state(request)
        if request.prompt_embeds is None:
            end = self._hash(state, (request.num_tokens - 1) // self.block_size)
            if end >= self.config.min_hit_blocks:
                self._lookup(state, 0, end)

    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether async;
        ``None`` while the daemon has not answered."""
        if request.prompt_embeds is not None:
            return 0, False  # token ids do not name embeddings
        state = self._state(request)
        start = num_computed_tokens // self.block_size
        # Never the block holding the last token: vLLM needs one real forward for logits.
        end = self._hash(state, (request.num_tokens - 1) // self.block_size)
        if end - start < self.config.min_hit_blocks:
            return 0, False
        lookup = self._lookup(state, start, end)
        if not lookup.done():
            return None, False
        state.offer, state.offer_start = lookup.hits(), start
        if state.offer.total < self.config.min_hit_blocks:
            return 0, False
        return state.offer.total * self.block_size, self.config.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plans the load of an accepted hit into the blocks vLLM allocated for it."""
        if num_external_tokens == 0:
            return
        state = self._requests[request.request_id]
        assert state.offer is not None, "vLLM accepted a hit kvtier did not offer"
        start = state.offer_start
        num = num_external_tokens // self.block_size
        self._hash(state, start + num)  # (rehashed if reset_cache came in between)
        block_ids = list(blocks.get_block_ids()[0][start : start + num])
        sync = not self.config.load_async
        self._loads.append(
            LoadSpec(
                req_id=request.request_id,
                block_ids=block_ids,
                hashes=state.hashes.packed(start, start + num),
                sync=sync,
            )
        )
        state.load = PlannedLoad(start, block_ids, sync)
        self._loading[request.request_id] = state
        if state.stored_blocks >= start:
            state.stored_blocks = max(state.stored_blocks, start + num)
        state.host_hit_blocks = min(state.offer.host, num)
        state.disk_hit_blocks = min(state.offer.disk, num - state.host_hit_blocks)
        state.remote_hit_blocks = num - state.host_hit_blocks - state.disk_hit_blocks
        self.stats.add("host_hit_tokens", state.host_hit_blocks * self.block_size)
        self.stats.add("disk_hit_tokens", state.disk_hit_blocks * self.block_size)
        self.stats.add("remote_hit_tokens", state.remote_hit_blocks * self.block_size)
        # The answer is used up: if vLLM asks again (the load failed), ask the daemon again.
        self._lookups.discard(state.lookup)
        state.lookup, state.offer = None, None

    def hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` split by the tier that holds them."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return {}
        split = {
            CacheHitSource.HOST: state.host_hit_blocks * self.block_size,
            CacheHitSource.DISK: state.disk_hit_blocks * self.block_size,
            # vLLM names no remote-store source; its "uninstrumented or remote store" one
            CacheHitSource.EXTERNAL_UNSPECIFIED: state.remote_hit_blocks * self.block_size,
        }
        if sum(split.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {source: n for source, n in split.items() if n}

    @property
    def lookups_in_flight(self) -> int:
        return self._lookups.in_flight()

    def wait_for_lookups(self, timeout: float | None = None) -> bool:
        """Blocks until the daemon answered every lookup in flight; for tests, which want the
        steps they take not to depend on how fast it answers. vLLM never waits."""
        return self._lookups.wait(timeout)

    # ---- steps ----

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        """This step's loads and stores; clears what it hands out."""
        meta = KVTierMetadata(loads=self._loads, stores=self._stores, hold=self._hold_new)
        self._loads, self._stores, self._hold_new = [], [], set()
        # Preemptions first: a request preempted by reset_prefix_cache is resumed in the
        # same step and reported in both, and its resumption is the newer fact.
        for req_id in scheduler_output.preempted_req_ids or ():
            meta.preempted.add(req_id)
            state = self._requests.get(req_id)
            if state is not None:
                self._preempted(state)
        scheduled = scheduler_output.num_scheduled_tokens
        for load in meta.loads:
            if load.sync:
                # This step computes over the load: store that once the load proved good.
                state = self._requests[load.req_id]
                computed = state.request.num_computed_tokens
                state.verify_end = computed + scheduled.get(load.req_id, 0)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests[new.req_id]
            state.block_ids = list(new.block_ids[0])
            if not state.scheduled:
                # Below num_computed_tokens lie GPU hits (stored by whoever computed them)
                # and kvtier loads; everything from there on is computed, so stored, here.
                state.stored_blocks = new.num_computed_tokens // self.block_size
            # else it is resumed (a streaming session's next chunk): it keeps its count.
            self._admitted(state)
            self._plan_compute_store(meta, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._admitted(state)
            end = cached.num_computed_tokens[i] + scheduled[req_id]
            self._plan_compute_store(meta, state, end)
        return meta

    def _admitted(self, state: RequestState) -> None:
        state.scheduled = state.running = True
        if state.lookup is not None:
            # An answer holds for one wait: once it runs, its own stores change what the
            # daemon holds, so a later admission asks again.
            self._lookups.discard(state.lookup)
            state.lookup = None

    def _preempted(self, state: RequestState) -> None:
        """Its blocks are gone: whatever it computes from now on is fresh KV."""
        state.block_ids = []
        state.running = False
        state.stores_issued = False  # stores in flight read freed blocks; the workers order them
        state.stale = False
        if state.load is not None:
            # A sync load never proved good: what it counted as stored may not be.
            state.stored_blocks = min(state.stored_blocks, state.load.start)
            self._loading.pop(state.request.request_id, None)
            state.load = None
        state.verify_end = 0

    def _plan_compute_store(self, meta: KVTierMetadata, state: RequestState, end: int) -> None:
        if self.config.store_policy != "on_compute":
            return
        spec = self._store_spec(state, end // self.block_size)
        if spec is not None:
            meta.stores.append(spec)

    def _store_spec(self, state: RequestState, full_blocks: int) -> StoreSpec | None:
        """A store of blocks ``[stored_blocks, full_blocks)`` whose ids and tokens are known."""
        request = state.request
        if state.stale:
            return None
        if state.verify_end:
            processed = request.num_computed_tokens - request.num_in_flight_tokens
            if processed < state.verify_end:
                return None  # vLLM has not processed the sync load's step without error yet
            state.verify_end = 0
            self._loading.pop(request.request_id, None)
            state.load = None
        full_blocks = min(full_blocks, len(state.block_ids))
        end = min(self._hash(state, full_blocks), full_blocks)
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
        self._loading.pop(request.request_id, None)
        if state is None:
            return False
        self._lookups.discard(state.lookup)
        if not state.running:
            # Waiting, preempted, or loading (vLLM sets the finished status first, and frees
            # the blocks of a load in flight once it reports in finished_recving): it holds
            # no KV it computed, so nothing is stored and nothing of it is held for us.
            return False
        # on_finish stores it all now; on_compute has only blocks computed over a sync load
        # left, if that load proved good.
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
        """Rewinds what failed loads counted as stored; forgets loads that landed."""
        invalid = output.invalid_block_ids
        if invalid:
            for state in self._loading.values():
                load = state.load
                first = next((i for i, b in enumerate(load.block_ids) if b in invalid), None)
                if first is not None:
                    state.stored_blocks = min(state.stored_blocks, load.start + first)
        failed = output.failed_recving or set()
        for req_id in (output.finished_recving or set()) | failed:
            state = self._loading.pop(req_id, None)
            if state is None:
                continue  # finished meanwhile
            if req_id in failed:
                state.stored_blocks = min(state.stored_blocks, state.load.start)
            state.load = None
        for req_id in output.finished_sending or ():
            self._held.discard(req_id)

    def reset_cache(self) -> bool:
        """Fences off every block stored so far: this engine never loads them again.

        Called by vLLM's ``reset_prefix_cache(reset_connector=True)``, e.g. after an RL
        weight update. What is guaranteed from the moment it returns:

        * Every hash this engine computes is salted with a fresh random epoch, so no lookup
          or load finds a block stored before the reset, by this engine or any other. Those
          blocks stay in the daemon for engines that did not reset (and for this one after a
          restart, which loads the checkpoint's weights again) until its LRU evicts them.
        * Answers to lookups made before the reset, in flight or kept, are dropped.
        * Stores in flight complete under the old hashes, where nothing asks for them.
        * A request that holds KV computed before the reset (running, waiting with blocks,
          or loading) stores nothing more: its later blocks attend to that KV. Once
          preempted it recomputes, and stores again.

        Returns False if an async load is in flight: its request will compute over KV from
        before the reset (vLLM's own reset fails then too, as that request holds blocks).
        """
        nonce = os.urandom(16)
        self._seeds = [xxhash.xxh3_128_digest(seed + nonce) for seed in self._base_seeds]
        self._lookups.clear()
        for state in self._requests.values():
            state.hashes.reseed(self._seeds)
            state.lookup = None
            request = state.request
            if request.num_computed_tokens > 0 or state.load is not None:
                state.stale = True
        in_flight = [req_id for req_id, state in self._loading.items() if not state.load.sync]
        if in_flight:
            log.warning(
                "kvtier reset_cache: %d async loads from before the reset still in flight "
                "(%s); those requests run on KV from before it",
                len(in_flight),
                ", ".join(in_flight[:4]),
            )
        return not in_flight

    def take_stats(self) -> KVTierStats | None:
        failures = self.client.failures
        self.stats.add("daemon_failures", failures - self._failures_seen)
        self._failures_seen = failures
        return self.stats.take()
