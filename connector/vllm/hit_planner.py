"""The scheduler side's lookups and load plans: what kvtier can load for a request (as much
of the daemon's hit as the load gate finds worth loading), and the load of a hit vLLM
accepted. ``SchedulerSide`` (``scheduler``, whose docstring tells the whole step) owns one
``HitPlanner`` and routes vLLM's hit questions to it."""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.vllm.adapters import AdapterKeys
from kvtier.connector.vllm.capacity import TierWatch
from kvtier.connector.vllm.compat import VllmDrift, skips_external_kv
from kvtier.connector.vllm.config import KVTierConfig
from kvtier.connector.vllm.gate import LoadGate
from kvtier.connector.vllm.groups import KVGroup
from kvtier.connector.vllm.hits import Chain
from kvtier.connector.vllm.lookup import Lookup, Lookups
from kvtier.connector.vllm.metadata import LoadSpec
from kvtier.connector.vllm.request import PlannedLoad, RequestHashes, RequestState
from kvtier.connector.vllm.stats import KVTierStats
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.lower import LowerHits


class HitPlanner:
    """Owns the scheduler's request table, its lookups in flight and the loads planned for the
    next step; ``seeds`` are each group's shard seeds in the current cache epoch."""

    def __init__(
        self,
        config: KVTierConfig,
        groups: list[KVGroup],
        align: int,
        hash_block_size: int | None,
        seeds: list[list[BlockHash]],
        clients: dict[str, DaemonClient],
        stats: KVTierStats,
        drift: VllmDrift,
    ):
        self.config = config
        self.groups = groups
        self.align = align
        self.hash_block_size = hash_block_size
        self.seeds = seeds
        self.clients = clients
        self.client = clients[groups[0].layout.signature]
        self.stats = stats
        self.drift = drift
        self.requests: dict[str, RequestState] = {}
        self.loading: dict[str, RequestState] = {}
        """Requests whose planned load has not proved good or landed yet."""
        self.lookups = Lookups()
        self.adapters = AdapterKeys()
        """Each LoRA adapter's key: its content, so a reloaded adapter names new blocks."""
        self.loads: list[LoadSpec] = []
        """Loads planned since the last step's metadata took them."""
        self.watch = TierWatch(self.client, clients)
        self.gate = LoadGate(sum(group.layout.block_bytes / group.block_size for group in groups))

    def close(self) -> None:
        self.watch.close()

    def observe_step(self, scheduler_output) -> None:
        """Tells the load gate a step is being planned, and whether it prefills."""
        cached = scheduler_output.scheduled_cached_reqs
        prefills = bool(scheduler_output.scheduled_new_reqs) or any(
            computed < self.requests[req_id].request.num_prompt_tokens
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            if req_id in self.requests
        )
        self.gate.observe_step(scheduler_output.total_num_scheduled_tokens, prefills)

    def report_tiers(self) -> None:
        """Adds the daemon's capacity gauges to the stats when a fresher reading came in."""
        gauges = self.watch.poll()
        if gauges:
            self.stats.set_gauges(gauges)

    def take_loads(self) -> list[LoadSpec]:
        loads, self.loads = self.loads, []
        return loads

    def reseed(self, seeds: list[list[BlockHash]]) -> None:
        """Moves every request's hash chains to a new cache epoch; drops every answer."""
        self.seeds = seeds
        self.lookups.clear()
        for state in self.requests.values():
            for hashes, group_seeds in zip(state.hashes, seeds, strict=True):
                hashes.reseed(group_seeds)
            state.lookup = None

    def forget(self, state: RequestState) -> None:
        """Drops the request's answer: it is used up or the question changed."""
        self.lookups.discard(state.lookup)
        state.lookup = None

    def _state(self, request) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            lora = self.adapters.key(request.lora_request)
            hashes = [
                RequestHashes(request, seeds, group.block_size, self.hash_block_size, lora)
                for group, seeds in zip(self.groups, self.seeds, strict=True)
            ]
            state = RequestState.new(request, hashes)
            self.requests[request.request_id] = state
        return state

    def hash_to(self, state: RequestState, num_tokens: int) -> int:
        """Hashes every group up to ``num_tokens``; returns the tokens hashed in every group,
        a multiple of ``align``. Whatever vLLM took back is no longer stored or asked."""
        end = num_tokens
        for g, hashes in enumerate(state.hashes):
            size = self.groups[g].block_size
            end = min(end, hashes.extend_to(state.request, num_tokens // size) * size)
            cut = hashes.take_cut()
            if cut is not None:
                state.stored_blocks[g] = min(state.stored_blocks[g], cut)
                self.lookups.discard(state.lookup)
                state.lookup = None
        return end // self.align * self.align

    def _lookup(self, state: RequestState, start: int, end: int) -> Lookup:
        """The lookup of tokens ``[start, end)``: the one asked before, or a new one."""
        lookup = state.lookup
        if (
            lookup is None
            or (lookup.start, lookup.end) != (start, end)
            or lookup.stale(self.client.lookup_hold_s)
        ):
            self.lookups.discard(lookup)
            chains = [
                Chain(group, shard, layout.signature)
                for group, hashes in zip(self.groups, state.hashes, strict=True)
                for shard, layout in zip(
                    hashes.per_shard(0, end // group.block_size),
                    group.shard_layouts(),
                    strict=True,
                )
            ]
            lookup = Lookup.ask(self._ask, chains, start, end, self.align)
            self.lookups.add(lookup)
            state.lookup = lookup
            self.stats.add("lookup_tokens", end - start)
        return lookup

    def _ask(
        self, chain: Chain, hashes: list[BlockHash], then: Callable[[LowerHits], None]
    ) -> None:
        self.clients[chain.signature].lookup_then(hashes, then)

    @property
    def _min_hit_tokens(self) -> int:
        return self.config.min_hit_blocks * self.align

    def on_new_request(self, request) -> None:
        """Asks about the whole prompt at once, so the answer is in when vLLM asks (its own GPU
        hit then being 0, which a prompt that reaches kvtier usually has)."""
        state = self._state(request)  # stored as it is computed, even if it may read nothing
        if not self._may_read(request):
            return
        end = self.hash_to(state, request.num_tokens - 1)
        if end >= self._min_hit_tokens:
            self._lookup(state, 0, end)

    def may_load_async(self, request) -> bool:
        """Whether ``request`` will load asynchronously: the daemon's answer about its prompt is
        in (from ``on_new_request``; the lookup index answers most at once) and is a hit worth
        loading. vLLM asks as it queues the request, to let its load start while the running
        batch is full: an answer still on its way says no (the request then loads once it
        reaches a running slot) rather than hold back other loads for a hit that may not be."""
        if not self.config.load_async or not self._may_read(request):
            return False
        state = self.requests.get(request.request_id)
        lookup = state.lookup if state is not None else None
        if lookup is None or not lookup.done():
            return False
        return lookup.hits().tokens >= self._min_hit_tokens

    def _may_read(self, request) -> bool:
        """Token ids name the request's KV (not embeddings), it may read KV it did not compute,
        and the connector still knows which block holds what (``drift``): else it is never
        looked up."""
        return (
            not self.drift.lost_track
            and request.prompt_embeds is None
            and not skips_external_kv(request)
        )

    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether async;
        ``None`` while the daemon has not answered."""
        if not self._may_read(request):
            return 0, False
        state = self._state(request)
        start = num_computed_tokens // self.align * self.align
        # Never the block holding the last token: vLLM needs one real forward for logits.
        end = self.hash_to(state, request.num_tokens - 1)
        if end - start < self._min_hit_tokens:
            return 0, False
        lookup = self._lookup(state, start, end)
        if not lookup.done():
            return None, False
        state.offer, state.offer_start = lookup.hits(), start
        tokens = state.offer.tokens
        state.declined = None
        if self.config.load_gate:
            tokens, state.declined = self.gate.cut(state.offer, self.watch.read_bytes_per_s)
            tokens = tokens // self.align * self.align
        if tokens < self._min_hit_tokens:
            return 0, False
        return tokens, self.config.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plans the load of an accepted hit into the blocks vLLM allocated for it: in each
        group, the blocks the token after the hit attends to."""
        state = self.requests.get(request.request_id)
        if state is not None and state.declined:
            for tier, tokens in state.declined.items():
                self.stats.add(f"declined_hit_tokens.{tier}", tokens)
            state.declined = None
        if num_external_tokens == 0:
            return
        assert state is not None, "vLLM accepted a hit for a request kvtier never saw"
        assert state.offer is not None, "vLLM accepted a hit kvtier did not offer"
        start = state.offer_start
        end = start + num_external_tokens
        self.hash_to(state, end)  # (rehashed if reset_cache came in between)
        all_ids = blocks.get_block_ids()
        sync = not self.config.load_async
        planned = []
        for g, group in enumerate(self.groups):
            size = group.block_size
            first = max(start // size, group.first_needed_block(end))
            last = end // size
            block_ids = list(all_ids[group.index][first:last])
            planned.append((first, block_ids))
            if block_ids:
                self.loads.append(
                    LoadSpec(
                        req_id=request.request_id,
                        block_ids=block_ids,
                        hashes=state.hashes[g].packed(first, last),
                        sync=sync,
                        group=group.index,
                    )
                )
            if state.stored_blocks[g] >= start // size:
                # Loaded, or (below a window) null: nothing of it is stored from here.
                state.stored_blocks[g] = max(state.stored_blocks[g], last)
        state.load = PlannedLoad(start, planned, sync)
        self.loading[request.request_id] = state
        offer = state.offer
        state.host_hit_tokens = min(offer.host_tokens, num_external_tokens)
        state.disk_hit_tokens = min(offer.disk_tokens, num_external_tokens - state.host_hit_tokens)
        state.remote_hit_tokens = (
            num_external_tokens - state.host_hit_tokens - state.disk_hit_tokens
        )
        self.stats.add("host_hit_tokens", state.host_hit_tokens)
        self.stats.add("disk_hit_tokens", state.disk_hit_tokens)
        self.stats.add("remote_hit_tokens", state.remote_hit_tokens)
        # The answer is used up: if vLLM asks again (the load failed), ask the daemon again.
        self.forget(state)
        state.offer = None

    def hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` split by the tier that holds them."""
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return {}
        split = {
            CacheHitSource.HOST: state.host_hit_tokens,
            CacheHitSource.DISK: state.disk_hit_tokens,
            # vLLM names no remote-store source; its "uninstrumented or remote store" one
            CacheHitSource.EXTERNAL_UNSPECIFIED: state.remote_hit_tokens,
        }
        if sum(split.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {source: n for source, n in split.items() if n}

    @property
    def lookups_in_flight(self) -> int:
        return self.lookups.in_flight()

    def wait_for_lookups(self, timeout: float | None = None) -> bool:
        """Blocks until the daemon answered every lookup in flight; for tests, which want the
        steps they take not to depend on how fast it answers. vLLM never waits."""
        return self.lookups.wait(timeout)
