"""The worker half of ``KVTierConnector``: copies between vLLM's KV cache and the daemon.

Loads: ``Acquire`` pins the host slots holding the planned hashes (promoting disk hits), the
copy engine copies them into vLLM's blocks on its load stream, and the slots are released
once the copy has read them. A sync load is acquired and queued before the forward pass,
which is ordered after it; an async load is acquired on a helper thread and copied when the
answer is there, and its request is reported in ``finished_recving`` when the copy lands.
Whatever the daemon could not supply (gone, down, checksum miss) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it.

Stores: at ``wait_for_save`` the step's newly full blocks are queued, and ONE ``Reserve``
per step asks for their slots on a helper thread (the daemon answers "already stored" for
blocks it holds, which are skipped). The copy starts at the NEXT step's start
(``vllm_stores``), on the copy engine's store stream after the compute stream's queued work,
and a helper thread commits the slots when the bytes are in. Finished requests whose blocks
vLLM holds for us are reported in ``finished_sending`` once no store reads them any more.

The copies themselves never make the engine's thread wait for the GPU (``CopyEngine``); the
arena is page-locked by the copy engine on this thread, under this worker's device. Reserves,
acquires for async loads and commits run on helper threads (the commit thread never holds up
a release: releases are sent without waiting); every daemon call is bounded by the client's
deadline and never raises for daemon trouble.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from kvtier.connector.vllm_config import KVTierConfig
from kvtier.connector.vllm_layout import kv_placement
from kvtier.connector.vllm_loads import StreamedLoad
from kvtier.connector.vllm_metadata import KVTierMetadata, LoadSpec, StoreSpec, unpack
from kvtier.connector.vllm_stats import KVTierStats
from kvtier.connector.vllm_stores import PendingStore, StoreQueue
from kvtier.tiers.copy_engine import CopyEngine
from kvtier.tiers.host import ALREADY_STORED
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.transfer import Transfer

log = logging.getLogger(__name__)


class WorkerSide:
    """Moves blocks for one worker (one tensor-parallel rank)."""

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout,
        layer_names: list[str],
        rank: int,
        engine_group: str = "",
    ):
        self.config = config
        self.layout = layout
        self.layer_names = layer_names
        self.rank = rank
        self.client = config.client(layout, f"vllm-worker-{rank}", engine_group=engine_group)
        if config.connect_wait_s and not self.client.wait_connected(config.connect_wait_s):
            log.warning(
                "kvtier daemon %s not reachable yet; loads miss until it is", config.target()
            )
        self.stats = KVTierStats()
        self.engine: CopyEngine | None = None
        # Acquire answers for async loads; reserves for deferred stores; commits.
        self._acquirer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-acquire")
        self._reserver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-reserve")
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-commit")
        self._async_loads: dict[str, StreamedLoad] = {}
        self._deferred = StoreQueue(self.client.reserve, self._reserver)
        self._stores_in_flight: list[Transfer] = []
        self._storing: Counter[str] = Counter()
        self._held: set[str] = set()
        self._load_errors: set[int] = set()
        self._commits: deque[tuple[int, bool]] = deque()  # (blocks, ok), from the committer

    # ---- set-up and teardown ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        placement = kv_placement(self.layout, kv_caches, self.layer_names)
        self.engine = CopyEngine(placement, self.client.slab)
        log.info(
            "kvtier worker %d: %d layers, %d blocks of %d B on %s (%s), arena %s",
            self.rank,
            self.layout.num_layers,
            placement.num_blocks,
            self.layout.block_bytes,
            placement.device,
            "one DMA per block" if placement.block_contiguous else "staged",
            "page-locked" if self.engine.host_pinned else "not locked yet",
        )

    def drain(self) -> None:
        """Starts every deferred store, then waits until every copy has landed and every
        commit and release has been answered."""
        if self.engine is not None:
            for store, slots in self._deferred.take_all():
                self._copy_out(store, slots)
            self.engine.synchronize()
        self._finisher.submit(lambda: None).result()
        self.client.settle()

    def wait_for_loads(self, timeout: float | None = None) -> None:
        """Blocks until every async load begun so far has landed and every deferred store has
        its slots (or ``timeout``); for an engine that has nothing else to run this step."""
        self._deferred.wait_reserved(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(load.landed for load in self._async_loads.values()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            pending = [load.acquiring for load in self._async_loads.values() if load.acquiring]
            wait(pending, timeout=left)
            if self.engine is not None:
                self.engine.synchronize()
            self._advance_loads()

    def shutdown(self) -> None:
        """Lets every copy land, hands every slot back and closes the session."""
        for load in self._async_loads.values():
            load.abandon(self._release)
        self._async_loads.clear()
        self.drain()
        self._acquirer.shutdown(wait=True)
        self._reserver.shutdown(wait=True)
        self._finisher.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()  # unlocks the arena before the client unmaps it
        self.client.close()

    # ---- the step ----

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Starts the previous steps' stores (those of preempted requests without fail), and
        orders this step's work after stores still reading blocks vLLM just freed."""
        self._start_stores(meta.preempted)
        if meta.preempted:
            for transfer in self._stores_in_flight:
                transfer.order_before()

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        self._start_stores()
        for spec in meta.loads:
            if spec.sync:
                self._load_now(spec)
            else:
                load = StreamedLoad(spec, unpack(spec.hashes[self.rank]))
                self._async_loads[spec.req_id] = load
                self._advance(load)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Queues this step's stores; their copies start with the next step."""
        self._held |= meta.hold
        if meta.stores:
            self._queue_stores(meta.stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) as of now; never blocks on a copy."""
        assert self.engine is not None, "register_kv_caches was not called"
        self.engine.poll()
        self._advance_loads()
        self._stores_in_flight = [t for t in self._stores_in_flight if not t.done()]
        recving = {req_id for req_id, load in self._async_loads.items() if load.landed}
        for req_id in recving:
            del self._async_loads[req_id]
        sending = {req_id for req_id in self._held if not self._storing[req_id]}
        self._held -= sending
        return sending, recving

    @property
    def deferred_stores(self) -> int:
        """Steps' stores handed over and not started yet (they start with the next step)."""
        return len(self._deferred)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> KVTierStats | None:
        while self._commits:
            blocks, ok = self._commits.popleft()
            if ok:
                self.stats.add("stored_blocks", blocks)
                self.stats.add("stored_bytes", blocks * self.layout.block_bytes)
            else:
                self.stats.add("store_failed_blocks", blocks)
        return self.stats.take()

    # ---- loads ----

    def _load_now(self, spec: LoadSpec) -> None:
        hashes = unpack(spec.hashes[self.rank])
        slots = self.client.acquire(hashes)
        transfer = self._copy_in(spec, slots)
        if transfer is not None:
            transfer.order_before()  # this step's attention reads the blocks

    def _advance_loads(self) -> None:
        for load in self._async_loads.values():
            self._advance(load)

    def _advance(self, load: StreamedLoad) -> None:
        # The room the acquires still on their way will take: else two loads advanced in
        # one step would both ask for the same room, and the later be answered short (its
        # blocks recomputed). Summed before the room is read, so that an acquire answered
        # in between is counted twice (asks less) rather than not at all.
        asking = sum(
            other.asked
            for other in self._async_loads.values()
            if other.acquiring is not None and not other.acquiring.done()
        )
        load.advance(
            lambda hashes: self._acquirer.submit(self.client.acquire, hashes),
            self._copy_slots,
            self._failed,
            self.client.acquire_room() - asking,
            self.client.chunk_blocks,
        )

    def _copy_in(self, spec: LoadSpec, slots: list[int]) -> Transfer | None:
        """Copies the acquired prefix of a (sync) load; the rest of its blocks are errors."""
        self._failed(spec, spec.block_ids[len(slots) :])
        return self._copy_slots(slots, spec.block_ids[: len(slots)]) if slots else None

    def _copy_slots(self, slots: list[int], block_ids: list[int]) -> Transfer:
        """Copies slots into vLLM's blocks; the slots are released once the copy read them."""
        self.stats.add("loaded_blocks", len(slots))
        self.stats.add("loaded_bytes", len(slots) * self.layout.block_bytes)
        # sent without waiting once the copy has read them: never behind a commit
        return self.engine.load(slots, block_ids, callback=lambda: self.client.release(slots))

    def _failed(self, spec: LoadSpec, block_ids: list[int]) -> None:
        if not block_ids:
            return
        self._load_errors.update(block_ids)
        self.stats.add("load_failed_blocks", len(block_ids))
        log.info(
            "kvtier: %d of %d blocks of %s not loadable; recomputing them",
            len(block_ids),
            len(spec.block_ids),
            spec.req_id,
        )

    def _release(self, slots: list[int]) -> None:
        if slots:
            self.client.release(slots)

    # ---- stores ----

    def _queue_stores(self, specs: list[StoreSpec]) -> None:
        hashes: list[bytes] = []
        block_ids: list[int] = []
        owners: list[str] = []
        for spec in specs:
            mine = unpack(spec.hashes[self.rank])
            hashes += mine
            block_ids += spec.block_ids
            owners += [spec.req_id] * len(mine)
        self._storing.update(owners)  # their requests stay held until the copies land
        self._deferred.add(hashes, [], block_ids, owners)

    def _start_stores(self, must: Collection[str] = ()) -> None:
        """Copies the deferred stores whose slots are reserved (waits only for ``must``'s)."""
        if self.engine is None:
            return
        for store, slots in self._deferred.take_ready(must):
            self._copy_out(store, slots)

    def _copy_out(self, store: PendingStore, slots: list[int]) -> None:
        picked = [i for i, slot in enumerate(slots) if slot >= 0]
        deduped = sum(1 for slot in slots if slot == ALREADY_STORED)
        self.stats.add("deduplicated_blocks", deduped)
        self.stats.add("store_failed_blocks", len(slots) - deduped - len(picked))
        self._stored(Counter(store.owners[i] for i, slot in enumerate(slots) if slot < 0))
        if not picked:
            return
        mine_slots = [slots[i] for i in picked]
        readers = Counter(store.owners[i] for i in picked)

        def done() -> None:
            self._finisher.submit(self._commit, mine_slots)
            self._stored(readers)

        transfer = self.engine.store(
            [store.block_ids[i] for i in picked], mine_slots, callback=done
        )
        if not transfer.done():
            self._stores_in_flight.append(transfer)

    def _stored(self, blocks: Counter[str]) -> None:
        """Blocks no store reads any more, by request."""
        for req_id, n in blocks.items():
            self._storing[req_id] -= n
            if not self._storing[req_id]:
                del self._storing[req_id]

    def _commit(self, slots: list[int]) -> None:
        """Runs on the committer thread; the engine thread counts the outcome."""
        self._commits.append((len(slots), self.client.commit(slots)))
