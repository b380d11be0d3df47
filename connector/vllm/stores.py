"""Stores handed to a worker at ``wait_for_save``, copied at the start of a later step.

Right after the forward pass vLLM copies the sampled tokens from the GPU to the host; a store
started at that moment competes with that small, latency-critical copy for the link. As
vLLM's own offloading connector does, the worker defers each step's stores to the start of
the next step (``handle_preemptions`` / ``start_load_kv``), by which time the sampler's copy
has landed, and the copy then overlaps the next forward pass. Meanwhile the slots are
reserved on a helper thread, so the daemon's round trip never runs on the engine's thread.

The blocks stay valid while they wait: vLLM keeps a finished request's blocks until the
worker reports it in ``finished_sending``, and a preempted request's stores are started (its
reservation waited for) before the step that may overwrite its freed blocks.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

Reserve = Callable[[list[bytes], list[bytes]], list[int]]


@dataclass(slots=True)
class PendingStore:
    """One step's stores: block ids, the request owning each, and the slots asked for them."""

    block_ids: list[int]
    owners: list[str]
    reserved: Future[list[int]]


class StoreQueue:
    """Deferred stores in the order they were handed over."""

    def __init__(self, reserve: Reserve, executor: Executor):
        self._reserve = reserve
        self._executor = executor
        self._pending: deque[PendingStore] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self, hashes: list[bytes], metas: list[bytes], block_ids: list[int], owners: list[str]
    ) -> None:
        """Queues a step's stores and asks for their slots on the helper thread; ``metas``
        (one per hash, or none) is each block's engine identity, kept with it below."""
        future = self._executor.submit(self._reserve, hashes, metas)
        self._pending.append(PendingStore(block_ids, owners, future))

    def take_ready(self, must: Collection[str] = ()) -> list[tuple[PendingStore, list[int]]]:
        """The leading stores whose slots are answered, with their slots; never waits, except
        for the stores of requests in ``must`` (and those queued before them)."""
        forced = -1
        for i, store in enumerate(self._pending):
            if not set(store.owners).isdisjoint(must):
                forced = i
        ready: list[tuple[PendingStore, list[int]]] = []
        while self._pending and (len(ready) <= forced or self._pending[0].reserved.done()):
            store = self._pending.popleft()
            ready.append((store, store.reserved.result()))
        return ready

    def wait_reserved(self, timeout: float | None = None) -> None:
        """Blocks until every queued store's slots are answered (or ``timeout``)."""
        wait([store.reserved for store in self._pending], timeout=timeout)

    def take_all(self) -> list[tuple[PendingStore, list[int]]]:
        """Every queued store with its slots, waiting for the answers."""
        ready = [(store, store.reserved.result()) for store in self._pending]
        self._pending.clear()
        return ready


class StoreReaders:
    """What stores not landed yet still read: each request (vLLM keeps a finished one's blocks
    until then) and, where vLLM may hand a block out again mid-request (a model with window
    groups: ``track_blocks``), each block."""

    def __init__(self, track_blocks: bool):
        self.requests: Counter[str] = Counter()
        self.blocks: Counter[int] = Counter()
        self._track_blocks = track_blocks

    def add(self, owners: list[str], block_ids: list[int]) -> None:
        self.requests.update(owners)
        if self._track_blocks:
            self.blocks.update(block_ids)

    def reads_any(self, block_ids: Collection[int]) -> bool:
        return self._track_blocks and any(block in self.blocks for block in block_ids)

    def done(self, readers: Counter[str], block_ids: list[int]) -> None:
        """Stores of ``readers`` (request → blocks) reading ``block_ids`` have landed."""
        for req_id, n in readers.items():
            self.requests[req_id] -= n
            if not self.requests[req_id]:
                del self.requests[req_id]
        if self._track_blocks:
            for block in block_ids:
                left = self.blocks[block] - 1
                if left > 0:
                    self.blocks[block] = left
                else:
                    self.blocks.pop(block, None)


class CommitAnswers:
    """The answers of a worker's commits, which come on its daemon client's thread, for the
    engine thread to count (``count``)."""

    def __init__(self) -> None:
        self._answers: deque[tuple[int, int, bool, int]] = deque()

    def add(self, blocks: int, block_bytes: int, ok: bool, deduplicated: int) -> None:
        """A commit of ``blocks`` answered; ``deduplicated`` of them a tier held already."""
        stored = blocks - deduplicated
        self._answers.append((stored, stored * block_bytes, ok, deduplicated))

    def count(self, add: Callable[[str, int], None]) -> None:
        """Counts the answers come so far with ``add(counter, value)``."""
        while self._answers:
            blocks, nbytes, ok, deduplicated = self._answers.popleft()
            add("deduplicated_blocks", deduplicated)
            if ok:
                add("stored_blocks", blocks)
                add("stored_bytes", nbytes)
            else:
                add("store_failed_blocks", blocks)
