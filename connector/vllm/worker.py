"""The worker half of ``KVTierConnector``: copies between vLLM's KV cache and the daemon.

Every KV cache group has its own copy engine over its layers' pages, and every distinct
layout its own daemon session (and arena); a load or store names its group. A rank loads
its shard of every group (``LoadSpec.hashes[shard]``); of ranks holding one shard (an MLA
latent is the same on every rank) only the first stores it.

Loads: ``Acquire`` pins the host slots holding the planned hashes (promoting disk hits), the
copy engine copies them into vLLM's blocks on its load stream, and the slots are released
once the copy has read them. A sync load is acquired and queued before the forward pass,
which is ordered after it; an async load is acquired on a helper thread and copied when the
answer is there, and its request is reported in ``finished_recving`` when the copies of all
of its groups land. Whatever the daemon could not supply (gone, down, checksum miss) is
reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it; for a model of
several groups, whose block ids vLLM cannot map back to requests, the request is reported
in ``failed_recving`` instead and vLLM recomputes all of it.

Stores: at ``wait_for_save`` the step's newly full blocks are queued, and ONE ``Reserve``
per step and group takes their slots on a helper thread: from those the session reserved
ahead, with no call, where enough are there (blocks the lookup index says are stored are
skipped), else by a call (the daemon answers "already stored" for blocks it holds). The copy
starts at the NEXT step's start (``stores``), on the copy engine's store stream after the
compute stream's queued work, and a helper thread sends the Commit, which names slots
reserved ahead, when the bytes are in, without waiting for its answer. Finished requests
whose blocks vLLM holds for us are reported in ``finished_sending`` once no store reads them
any more. A sliding-window group's blocks are freed by vLLM while their request runs; when a
step hands out a block a store still reads, that store starts first and the step is ordered
after it.

The copies never make the engine's thread wait for the GPU (``CopyEngine``); the client
page-locks each arena under this worker's device on its own thread as it maps it, so a daemon
restart never locks tens of GiB mid-step. A copy not started before its slots' session was
lost is dropped (a store's slots aborted, a load's blocks recomputed): the daemon fences those
slots until the client's next session proves nothing of its can land in them. Reserves, async
loads' acquires and commits run on helper threads (releases and commits are sent without
waiting); every daemon call has the client's deadline and never raises for daemon trouble."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial

import torch

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.vllm.config import KVTierConfig
from kvtier.connector.vllm.groups import KVGroup
from kvtier.connector.vllm.kv_memory import KVMemory
from kvtier.connector.vllm.loads import InFlight, StreamedLoad
from kvtier.connector.vllm.metadata import KVTierMetadata, LoadSpec, StoreSpec, unpack
from kvtier.connector.vllm.stats import DaemonTrouble, KVTierStats
from kvtier.connector.vllm.stores import CommitAnswers, PendingStore, StoreQueue, StoreReaders
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.transfer import Transfer
from kvtier.tiers.lower import ALREADY_STORED

log = logging.getLogger(__name__)


class WorkerSide:
    """Moves blocks for one worker (one tensor-parallel rank)."""

    def __init__(
        self, config: KVTierConfig, groups: list[KVGroup], rank: int, engine_group: str = ""
    ):
        self.config = config
        self.groups = {group.index: group for group in groups}
        self.rank = rank
        self.clients: dict[bytes, DaemonClient] = {}
        for group in groups:
            signature = group.layout.signature
            if signature not in self.clients:
                self.clients[signature] = config.client(
                    group.layout,
                    f"vllm-worker-{rank}",
                    engine_group=engine_group,
                    lookup_index=True,
                    reserve_ahead=True,
                )
        for client in self.clients.values():
            if config.connect_wait_s and not client.wait_connected(config.connect_wait_s):
                log.warning(
                    "kvtier daemon %s not reachable yet; loads miss until it is", config.target()
                )
                break
        self.stats = KVTierStats()
        self._memory = KVMemory(self.groups, self._client)
        # Acquire answers for async loads; reserves for deferred stores; commits.
        self._acquirer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-acquire")
        self._reserver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-reserve")
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-commit")
        self._async_loads: dict[str, list[StreamedLoad]] = {}
        self._deferred = {
            group.index: StoreQueue(self._client(group).reserve, self._reserver) for group in groups
        }
        self._stores_in_flight: list[Transfer] = []
        # Blocks read by stores not landed yet, where vLLM may hand them out mid-request.
        self._readers = StoreReaders(track_blocks=any(group.windowed for group in groups))
        self._delayed_free: set[str] = set()
        self._load_errors: set[int] = set()
        # vLLM maps failed block ids back to requests only for a model of one group.
        self._whole_request_failures = len(groups) > 1
        self._failed_loads: set[str] = set()
        self._failed_landed: set[str] = set()
        self._commits = CommitAnswers()
        self._trouble = DaemonTrouble(trips=True)

    def _client(self, group: KVGroup) -> DaemonClient:
        return self.clients[group.layout.signature]

    # ---- set-up and teardown ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._memory.register(kv_caches, self.rank)

    def unregister_kv_caches(self) -> None:
        """vLLM releases the KV cache's memory next (sleep, or a weight update under the
        extensible KV cache): every store reads its blocks now, every copy lands, and an async
        load not copied within the daemon's deadline is given up (vLLM recomputes it). No copy
        touches the cache again until ``restore_kv_caches``. Called again, does nothing."""
        if not self._memory.usable:
            return
        self.wait_for_loads(timeout=max(client.timeout_s for client in self.clients.values()))
        self.drain()
        for load in self._loads():
            load.give_up(self._client(self.groups[load.spec.group]).release, self._failed)
        self._memory.release()

    def restore_kv_caches(self) -> None:
        """The KV cache's memory is back at the views vLLM registered (what it held is gone):
        copies go on over placements derived again from those views. Idempotent."""
        self._memory.restore(self.rank)

    @property
    def engines(self) -> dict[int, CopyEngine]:
        """Each group's copy engine; none while vLLM has the KV cache released."""
        return self._memory.engines

    @property
    def in_flight(self) -> int:
        """Copies queued on the copy engines and not landed yet."""
        return sum(engine.in_flight for engine in self.engines.values())

    def drain(self) -> None:
        """Starts every deferred store, then waits until every copy has landed and every
        commit and release has been answered."""
        if self.engines:
            self._start_all_stores()
            for engine in self.engines.values():
                engine.synchronize()
        # At interpreter exit the pool has stopped already, after running every commit it held.
        with contextlib.suppress(RuntimeError):
            self._finisher.submit(lambda: None).result()
        for client in self.clients.values():
            client.settle()

    def wait_for_loads(self, timeout: float | None = None) -> None:
        """Blocks until every async load begun so far has landed and every deferred store has
        its slots (or ``timeout``); for an engine that has nothing else to run this step."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for queue in self._deferred.values():
            queue.wait_reserved(None if deadline is None else max(0, deadline - time.monotonic()))
        while not all(load.landed for load in self._loads()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            wait([load.acquiring for load in self._loads() if load.acquiring], timeout=left)
            for engine in self.engines.values():
                engine.synchronize()
            self._advance_loads()

    def shutdown(self) -> None:
        """Lets every copy land, hands every slot back and closes the sessions."""
        for load in self._loads():
            load.abandon(self._client(self.groups[load.spec.group]).release)
        self._async_loads.clear()
        self.drain()
        self._acquirer.shutdown(wait=True)
        self._reserver.shutdown(wait=True)
        self._finisher.shutdown(wait=True)
        self._memory.release()  # unlocks the arena before the client unmaps it
        for client in self.clients.values():
            client.close()

    # ---- the step ----

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Starts the previous steps' stores (preempted requests' without fail), and orders
        this step's work after stores still reading blocks vLLM just freed or handed out."""
        reused = self._readers.reads_any(meta.new_blocks)
        if reused:
            self._start_all_stores()
        else:
            self._start_stores(meta.preempted)
        if meta.preempted or reused:
            for transfer in self._stores_in_flight:
                transfer.order_before()

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        self._start_stores()
        started = []
        for spec in meta.loads:
            group = self.groups[spec.group]
            if spec.sync:
                self._load_now(group, spec)
            else:
                load = StreamedLoad(spec, unpack(spec.hashes[group.shard(self.rank)]))
                self._async_loads.setdefault(spec.req_id, []).append(load)
                started.append(load)
        if started:
            self._advance_loads(started)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Queues this step's stores; their copies start with the next step."""
        self._delayed_free |= meta.delay_free
        if meta.stores:
            self._queue_stores(meta.stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) as of now; never blocks on a copy."""
        assert self._memory.registered, "register_kv_caches was not called"
        for engine in self.engines.values():
            engine.poll()
        self._advance_loads()
        self._stores_in_flight = [t for t in self._stores_in_flight if not t.done()]
        recving = {
            req_id
            for req_id, loads in self._async_loads.items()
            if all(load.landed for load in loads)
        }
        for req_id in recving:
            del self._async_loads[req_id]
        self._failed_landed |= recving & self._failed_loads
        self._failed_loads -= recving
        sending = {req_id for req_id in self._delayed_free if not self._readers.requests[req_id]}
        self._delayed_free -= sending
        return sending, recving

    def take_failed_loads(self) -> set[str]:
        """Requests reported in ``finished_recving`` whose load failed as a whole (a model
        of several KV cache groups); vLLM recomputes them."""
        failed, self._failed_landed = self._failed_landed, set()
        return failed

    @property
    def deferred_stores(self) -> int:
        """Steps' stores handed over and not started yet (they start with the next step)."""
        return sum(len(queue) for queue in self._deferred.values())

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> KVTierStats | None:
        self._commits.count(self.stats.add)
        self._trouble.count(self.clients.values(), self.stats)
        return self.stats.take()

    # ---- loads ----

    def _loads(self) -> list[StreamedLoad]:
        return [load for loads in self._async_loads.values() for load in loads]

    def _load_now(self, group: KVGroup, spec: LoadSpec) -> None:
        hashes = unpack(spec.hashes[group.shard(self.rank)])
        slots = self._client(group).acquire(hashes)
        self._failed(spec, spec.block_ids[len(slots) :])
        if slots:
            transfer = self._copy_slots(group, spec, slots, spec.block_ids[: len(slots)])
            transfer.order_before()  # this step's attention reads the blocks

    def _advance_loads(self, loads: list[StreamedLoad] | None = None) -> None:
        """Advances ``loads`` (every async load by default) once each."""
        everyone = self._loads()
        in_flight = InFlight(everyone, lambda load: self._client(self.groups[load.spec.group]))
        for load in everyone if loads is None else loads:
            in_flight.advance(load, self._advance)

    def _advance(self, load: StreamedLoad, asking: int) -> None:
        """``asking``: the slots the session's acquires on their way will take. Counted before
        the room is read: an acquire answered in between counts twice (asks less), not never."""
        group = self.groups[load.spec.group]
        client = self._client(group)
        load.advance(
            lambda hashes: self._acquirer.submit(client.acquire, hashes),
            lambda slots, block_ids: self._copy_slots(group, load.spec, slots, block_ids),
            self._failed,
            client.acquire_room() - asking,
            client.chunk_blocks,
        )

    def _copy_slots(
        self, group: KVGroup, spec: LoadSpec, slots: list[int], block_ids: list[int]
    ) -> Transfer:
        """Copies slots into vLLM's blocks; the slots are released once the copy read them.
        Slots of a session lost meanwhile are handed back unread and their blocks failed."""
        client = self._client(group)
        if not client.connected or not self._memory.usable:
            # A new session opens only once every slot of the last one is handed back, so
            # held slots belong to the session in use, if there is one. (Or vLLM has the KV
            # cache released: the blocks are not there to copy into.)
            client.release(slots)
            self._failed(spec, block_ids)
            return Transfer(0, 0)  # nothing copied, nothing to wait for
        self.stats.add("loaded_blocks", len(slots))
        self.stats.add("loaded_bytes", len(slots) * group.layout.block_bytes)
        # sent without waiting once the copy has read them: never behind a commit
        return self.engines[group.index].load(
            slots, block_ids, callback=lambda: client.release(slots)
        )

    def _failed(self, spec: LoadSpec, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if self._whole_request_failures:
            self._failed_loads.add(spec.req_id)
        else:
            self._load_errors.update(block_ids)
        self.stats.add("load_failed_blocks", len(block_ids))
        log.info(
            "kvtier: %d of %d blocks of %s (group %d) not loadable; recomputing %s",
            len(block_ids),
            len(spec.block_ids),
            spec.req_id,
            spec.group,
            "the request" if self._whole_request_failures else "them",
        )

    # ---- stores ----

    def _queue_stores(self, specs: list[StoreSpec]) -> None:
        for index, queue in self._deferred.items():
            group = self.groups[index]
            mine = [spec for spec in specs if spec.group == index]
            if not mine or not group.stores(self.rank):
                continue  # another rank holding the same shard stores it
            shard = group.shard(self.rank)
            hashes: list[bytes] = []
            metas: list[bytes] = []
            block_ids: list[int] = []
            owners: list[str] = []
            for spec in mine:
                ours = unpack(spec.hashes[shard])
                hashes += ours
                # Routers hear of a block once: the identity goes with shard 0's copy.
                metas += spec.metas if shard == 0 and spec.metas else [b""] * len(ours)
                block_ids += spec.block_ids
                owners += [spec.req_id] * len(ours)
            self._readers.add(owners, block_ids)  # requests stay held until the copies land
            queue.add(hashes, metas if any(metas) else [], block_ids, owners)

    def _start_stores(self, must: Collection[str] = ()) -> None:
        """Copies the deferred stores whose slots are reserved (waits only for ``must``'s)."""
        if not self.engines:
            return
        for index, queue in self._deferred.items():
            for store, slots in queue.take_ready(must):
                self._copy_out(self.groups[index], store, slots)

    def _start_all_stores(self) -> None:
        """Copies every deferred store, waiting for their reservations."""
        for index, queue in self._deferred.items():
            for store, slots in queue.take_all():
                self._copy_out(self.groups[index], store, slots)

    def _copy_out(self, group: KVGroup, store: PendingStore, slots: list[int]) -> None:
        picked = [i for i, slot in enumerate(slots) if slot >= 0]
        deduped = sum(1 for slot in slots if slot == ALREADY_STORED)
        self.stats.add("deduplicated_blocks", deduped)
        self.stats.add("store_failed_blocks", len(slots) - deduped - len(picked))
        self._readers.done(
            Counter(store.owners[i] for i, slot in enumerate(slots) if slot < 0),
            [store.block_ids[i] for i, slot in enumerate(slots) if slot < 0],
        )
        if not picked:
            return
        mine_slots = [slots[i] for i in picked]
        mine_blocks = [store.block_ids[i] for i in picked]
        readers = Counter(store.owners[i] for i in picked)
        client = self._client(group)
        block_bytes = group.layout.block_bytes
        if not client.connected or not self._memory.usable:  # (see _copy_slots)
            client.abort(mine_slots)
            self.stats.add("store_failed_blocks", len(mine_slots))
            self._readers.done(readers, mine_blocks)
            return

        def done() -> None:
            then = partial(self._commits.add, len(mine_slots), block_bytes)
            self._finisher.submit(client.commit_later, mine_slots, then)
            self._readers.done(readers, mine_blocks)

        transfer = self.engines[group.index].store(mine_blocks, mine_slots, callback=done)
        if not transfer.done():
            self._stores_in_flight.append(transfer)
