"""The scheduler half of ``KVTierConnector``: lookups, load plans and store plans.

Per request and KV cache group it keeps kvtier's hash chains (one per shard: of a
tensor-parallel rank and a pipeline stage), the request's vLLM block ids and how many of its
blocks are in kvtier or handed to the workers to store. Each step:

* ``get_num_new_matched_tokens`` asks the daemon, for every group and shard and without
  waiting, which of the prompt's full blocks beyond vLLM's own GPU hit it holds (never the
  block of the last prompt token); the hit is the longest every group can serve, a
  sliding-window group needing only the blocks inside its window (``hits``). Until the
  answer is in it returns ``None`` and vLLM asks again next step; the answer is kept until
  the question changes.
* ``update_state_after_alloc`` turns an accepted hit into one load per group of those
  hashes into the blocks vLLM just allocated (a window group's: those inside the window).
* ``build_connector_meta`` emits the step's loads, and stores of the blocks this step fills
  (``on_compute``) or of finished requests (``on_finish``). A sliding-window group's blocks
  are always stored as they are filled: vLLM frees them once they slide out of the window,
  long before the request finishes.
* ``update_connector_output`` learns which loads failed (``invalid_block_ids`` from any
  rank, or for a model of several groups the whole request in ``failed_recving``, as vLLM
  wants it) and which async loads landed, and rewinds what it counted as stored.
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

from kvtier.connector.vllm.compat import DRIFT_ERRORS, VllmDrift, resumed_req_ids
from kvtier.connector.vllm.config import KVTierConfig
from kvtier.connector.vllm.events import TAG_BYTES, TierEvents, identities
from kvtier.connector.vllm.groups import KVGroup, alignment_tokens
from kvtier.connector.vllm.hit_planner import HitPlanner
from kvtier.connector.vllm.identity import ModelIdentity
from kvtier.connector.vllm.metadata import KVTierMetadata, StoreSpec
from kvtier.connector.vllm.pins import RequestPins
from kvtier.connector.vllm.request import RequestState
from kvtier.connector.vllm.stats import DaemonTrouble, KVTierStats, follow_worker_trips

log = logging.getLogger(__name__)


class SchedulerSide:
    """Plans kvtier loads and stores for vLLM's scheduler; its ``HitPlanner`` answers
    vLLM's hit questions and plans the loads."""

    def __init__(
        self,
        config: KVTierConfig,
        groups: list[KVGroup],
        model: ModelIdentity,
        hash_block_size: int | None = None,
        engine_group: str = "",
        publish_events: bool = False,
    ):
        """``publish_events``: follow the daemon's tiers for vLLM's KV event stream
        (``take_events``) and store with each block the identity routers need (which costs
        the engine's thread a little per block, so it is left out with events off)."""
        self.config = config
        self.groups = groups
        self.align = alignment_tokens(groups)
        """Tokens a hit is a multiple of: whole blocks of every group."""
        for group in groups:
            if hash_block_size and group.block_size % hash_block_size:
                raise ValueError(
                    f"vLLM hashes blocks of {hash_block_size} tokens, which does not divide "
                    f"kvtier's block of {group.block_size} (KV cache group {group.index})"
                )
        if len(groups) > 1 and not config.load_async:
            raise ValueError(
                "KVTierConnector needs load_async true for a model with several KV cache "
                "groups: vLLM can recompute a failed load of such a model only as a whole "
                "request, which it supports for async loads alone"
            )
        self.hash_block_size = hash_block_size
        self._base_seeds = [
            [ns.seed for ns in group.namespaces(model.name, model.fingerprint)] for group in groups
        ]
        self.clients = {}
        for group in groups:
            for layout in group.shard_layouts():
                if layout.signature not in self.clients:
                    self.clients[layout.signature] = config.client(
                        layout,
                        "vllm-scheduler",
                        map_arena=False,
                        engine_group=engine_group,
                        lookup_index=config.lookup_index,
                    )
        self.client = self.clients[groups[0].layout.signature]
        self.pins = RequestPins(groups, self.clients)
        for client in self.clients.values():
            if config.connect_wait_s and not client.wait_connected(config.connect_wait_s):
                log.warning(
                    "kvtier daemon %s not reachable yet; lookups miss until it is",
                    config.target(),
                )
                break
        # Window groups free blocks while a request runs: the workers must order the stores
        # still reading such a block before the step that reuses it.
        self._frees_blocks = any(group.windowed for group in groups)
        self.stats = KVTierStats()
        self.drift = VllmDrift(lambda n: self.stats.add("vllm_mismatches", n))
        self.hits = HitPlanner(
            config,
            groups,
            self.align,
            hash_block_size,
            [list(seeds) for seeds in self._base_seeds],
            self.clients,
            self.stats,
            self.drift,
        )
        self._stores: list[StoreSpec] = []
        self._delay_free_new: set[str] = set()
        self._delayed_free: set[str] = set()
        self._trouble = DaemonTrouble(trips=False)
        self._hash_tokens = hash_block_size or groups[0].block_size
        """Tokens vLLM hashes at a time (``request.block_hashes``)."""
        self._tags = self._namespace_tags()
        self._events = (
            TierEvents(list(self.clients.values()), lambda: self._tags, self._hash_tokens)
            if publish_events
            else None
        )

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        self.hits.close()
        for client in self.clients.values():
            client.close()

    # ---- steps ----

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        """This step's loads and stores; clears what it hands out. The loads were promised
        to vLLM, so they go out whatever else fails to read."""
        meta = KVTierMetadata(
            loads=self.hits.take_loads(), stores=self._stores, delay_free=self._delay_free_new
        )
        self._stores, self._delay_free_new = [], set()
        if self.drift.lost_track:
            return meta
        planned = list(meta.stores)
        try:
            self._follow_step(meta, scheduler_output)
        except DRIFT_ERRORS as error:
            meta.stores = planned  # block tables half updated: no store planned from them
            self.drift.seen("build_connector_meta", error, lost_track=True)
        return meta

    def _follow_step(self, meta: KVTierMetadata, scheduler_output) -> None:
        """Takes in preemptions, block tables, and the stores of the blocks this step fills."""
        self.hits.observe_step(scheduler_output)
        # Preemptions first: a request preempted by reset_prefix_cache is resumed in the
        # same step and reported in both, and its resumption is the newer fact.
        for req_id in scheduler_output.preempted_req_ids or ():
            meta.preempted.add(req_id)
            state = self.hits.requests.get(req_id)
            if state is not None:
                self._preempted(state)
        scheduled = scheduler_output.num_scheduled_tokens
        for load in meta.loads:
            if load.sync:
                # This step computes over the load: store that once the load proved good.
                state = self.hits.requests[load.req_id]
                computed = state.request.num_computed_tokens
                state.verify_end = computed + scheduled.get(load.req_id, 0)
        for new in scheduler_output.scheduled_new_reqs:
            state = self.hits.requests[new.req_id]
            state.block_ids = [list(new.block_ids[group.index]) for group in self.groups]
            if not state.scheduled:
                # Below num_computed_tokens lie GPU hits (stored by whoever computed them)
                # and kvtier loads; everything from there on is computed, so stored, here.
                computed = new.num_computed_tokens
                state.stored_blocks = [computed // group.block_size for group in self.groups]
            # else resumed (a streaming session's next chunk; from vLLM 0.34 on, a preemption)
            self._admitted(state)
            self._plan_compute_store(meta, state, new.num_computed_tokens + scheduled[new.req_id])
            self._note_new_blocks(meta, new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            state = self.hits.requests[req_id]
            new_ids = cached.new_block_ids[i]
            for g, group in enumerate(self.groups):
                if req_id in resumed:
                    state.block_ids[g] = list(new_ids[group.index]) if new_ids else []
                elif new_ids:
                    state.block_ids[g].extend(new_ids[group.index])
            self._admitted(state)
            end = cached.num_computed_tokens[i] + scheduled[req_id]
            self._plan_compute_store(meta, state, end)
            self._note_new_blocks(meta, new_ids)

    def _note_new_blocks(self, meta: KVTierMetadata, block_ids) -> None:
        if self._frees_blocks and block_ids:
            for ids in block_ids:
                meta.new_blocks.update(ids)

    def _admitted(self, state: RequestState) -> None:
        state.scheduled = state.running = True
        if state.lookup is not None:
            # An answer holds for one wait: once it runs, its own stores change what the
            # daemon holds, so a later admission asks again.
            self.hits.forget(state)

    def _preempted(self, state: RequestState) -> None:
        """Its blocks are gone: whatever it computes from now on is fresh KV."""
        state.block_ids = [[] for _ in self.groups]
        state.running = False
        state.stores_issued = False  # stores in flight read freed blocks; the workers order them
        state.stale = False
        if state.load is not None:
            # A sync load never proved good: what it counted as stored may not be.
            self._rewind(state, state.load.start)
            self.hits.loading.pop(state.request.request_id, None)
            state.load = None
        state.verify_end = 0

    def _rewind(self, state: RequestState, tokens: int) -> None:
        """Counts nothing from token ``tokens`` on as stored (vLLM recomputes it)."""
        for g, group in enumerate(self.groups):
            state.stored_blocks[g] = min(state.stored_blocks[g], tokens // group.block_size)

    def _plan_compute_store(self, meta: KVTierMetadata, state: RequestState, end: int) -> None:
        """Stores what this step fills: of every group (``on_compute``), or of the window
        groups alone, whose blocks vLLM frees before the request finishes (``on_finish``)."""
        on_compute = self.config.store_policy == "on_compute"
        meta.stores += self._store_specs(state, end, windowed_only=not on_compute)

    def _store_specs(
        self, state: RequestState, end: int, windowed_only: bool = False
    ) -> list[StoreSpec]:
        """Stores of each group's blocks from ``stored_blocks`` to the last full one before
        token ``end`` whose ids and tokens are known, skipping what slid out of a window."""
        request = state.request
        if state.stale or self.drift.lost_track:
            return []
        processed = request.num_computed_tokens - request.num_in_flight_tokens
        if state.verify_end:
            if processed < state.verify_end:
                return []  # vLLM has not processed the sync load's step without error yet
            state.verify_end = 0
            self.hits.loading.pop(request.request_id, None)
            state.load = None
        self.hits.hash_to(state, end)
        specs = []
        for g, group in enumerate(self.groups):
            if windowed_only and not group.windowed:
                continue
            hashes = state.hashes[g]
            stop = min(end // group.block_size, len(state.block_ids[g]), len(hashes))
            # vLLM has freed a window group's blocks below the window of what it processed.
            start = max(state.stored_blocks[g], group.first_needed_block(processed))
            state.stored_blocks[g] = max(state.stored_blocks[g], stop)
            if stop <= start:
                continue
            specs.append(
                StoreSpec(
                    req_id=request.request_id,
                    block_ids=state.block_ids[g][start:stop],
                    hashes=hashes.packed(start, stop),
                    group=group.index,
                    metas=identities(
                        request,
                        self.hits.seeds[g][0][:TAG_BYTES],
                        group.index,
                        group.block_size,
                        self._hash_tokens,
                        start,
                        stop,
                    )
                    if self._events is not None
                    else (),
                )
            )
        if specs:
            state.stores_issued = True
        return specs

    def request_finished(self, request, block_ids: list[list[int]]) -> bool:
        """True if vLLM must keep the request's blocks until a worker reports it sent;
        ``block_ids`` holds one list per KV cache group."""
        state = self.hits.requests.pop(request.request_id, None)
        self.hits.loading.pop(request.request_id, None)
        if state is None:
            return False
        self.hits.lookups.discard(state.lookup)
        if not state.running:
            # Waiting, preempted, or loading (vLLM sets the finished status first, and frees
            # the blocks of a load in flight once it reports in finished_recving): it holds
            # no KV it computed, so nothing is stored and nothing of it is held for us.
            return False
        # on_finish stores it all now; on_compute has only blocks computed over a sync load
        # left, if that load proved good.
        state.block_ids = [list(block_ids[group.index]) for group in self.groups]
        self._stores += self._store_specs(state, request.num_computed_tokens)
        self.pins.finished(state, stores_pending=state.stores_issued)
        if not state.stores_issued:
            return False
        self._delay_free_new.add(request.request_id)
        self._delayed_free.add(request.request_id)
        return True

    def has_pending_work(self) -> bool:
        """Blocks are held for stores still in flight: the engine must keep stepping."""
        return bool(self._delayed_free)

    def update_connector_output(self, output) -> None:
        """Rewinds what failed loads counted as stored; forgets loads that landed; stops
        asking a daemon a worker found not answering."""
        follow_worker_trips(output.kv_connector_stats, self.clients.values())
        invalid = output.invalid_block_ids
        if invalid:
            for state in self.hits.loading.values():
                fails = [
                    (first + i) * self.groups[g].block_size
                    for g, (first, ids) in enumerate(state.load.block_ids)
                    for i, block in enumerate(ids)
                    if block in invalid
                ]
                if fails:
                    self._rewind(state, min(fails))
        failed = output.failed_recving or set()
        for req_id in (output.finished_recving or set()) | failed:
            state = self.hits.loading.pop(req_id, None)
            if state is None:
                continue  # finished meanwhile
            if req_id in failed:
                self._rewind(state, state.load.start)
            state.load = None
        for req_id in output.finished_sending or ():
            self._delayed_free.discard(req_id)
            self.pins.sent(req_id)

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
        seeds = [
            [xxhash.xxh3_128_digest(seed + nonce) for seed in seeds] for seeds in self._base_seeds
        ]
        self._tags = self._namespace_tags()
        self.hits.reseed(seeds)
        for state in self.hits.requests.values():
            request = state.request
            if request.num_computed_tokens > 0 or state.load is not None:
                state.stale = True
        in_flight = [req_id for req_id, state in self.hits.loading.items() if not state.load.sync]
        if in_flight:
            log.warning(
                "kvtier reset_cache: %d async loads from before the reset still in flight "
                "(%s); those requests run on KV from before it",
                len(in_flight),
                ", ".join(in_flight[:4]),
            )
        return not in_flight

    def take_events(self) -> list:
        """vLLM's events for what the daemon's tiers stored and dropped since the last step
        (``events``); empty unless ``publish_events``."""
        return self._events.take() if self._events is not None else []

    def _namespace_tags(self) -> dict[bytes, int]:
        """Shard 0's namespace tag of each group in this cache epoch, to its group index."""
        return {
            seeds[0][:TAG_BYTES]: group.index
            for seeds, group in zip(self.hits.seeds, self.groups, strict=True)
        }

    def take_stats(self) -> KVTierStats | None:
        self._trouble.count(self.clients.values(), self.stats)
        self.hits.report_tiers()
        return self.stats.take()
