"""Block copies between an engine's per-layer KV tensors and host slots.

On CUDA every copy runs on a dedicated stream (one for stores, one for loads) and is ordered by
events: a store first waits for an event recorded on the compute stream, so it reads the KV the
engine wrote; a load hands back a ``Transfer`` whose event the engine waits on before attention
reads the blocks. A store gathers the blocks on the GPU into one contiguous staging buffer and
moves each 2 MiB-ish block to its slot with one DMA, rather than one small copy per layer.
On a CPU-only machine the same API copies synchronously and every transfer is done at once.

Completed transfers run their callbacks (commit the stored slots, release the read ones) from
``poll()``, which never blocks; events return to a pool for reuse.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.layout import KVLayout

Callback = Callable[[], None]


def copy_rows(
    dst: np.ndarray, dst_rows: Iterable[int], src: np.ndarray, src_rows: Iterable[int]
) -> None:
    """Copies whole rows between 2-D host arrays, one memcpy per row.

    On a CPU, numpy's row copy runs at memcpy speed, while torch's ``index_copy_`` and
    ``copy_`` on uint8 rows of a few MiB ran 5-15x slower on the machines we measured. numpy
    releases the GIL while it copies, so a large batch is split across a few threads, as one
    core alone cannot saturate memory bandwidth.
    """
    pairs = list(zip(dst_rows, src_rows, strict=True))
    threads = torch.get_num_threads()
    if threads < 2 or len(pairs) * dst.shape[1] < _PARALLEL_COPY_BYTES:
        _copy_pairs(dst, src, pairs)
        return
    list(_copy_pool().map(lambda part: _copy_pairs(dst, src, part), _split(pairs, threads)))


_PARALLEL_COPY_BYTES = 8 << 20


def _copy_pairs(dst: np.ndarray, src: np.ndarray, pairs: list[tuple[int, int]]) -> None:
    for d, s in pairs:
        np.copyto(dst[d], src[s])


def _split(pairs: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    return [pairs[i::parts] for i in range(parts)]


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="kvtier-copy")


class Transfer:
    """One batch of block copies in flight; done at once on CPU."""

    __slots__ = ("_staging", "callback", "event", "num_blocks")

    def __init__(
        self,
        event: torch.cuda.Event | None,
        staging: torch.Tensor | None,
        callback: Callback | None,
        num_blocks: int,
    ):
        self.event = event
        self._staging = staging  # kept alive until the copy has read or written it
        self.callback = callback
        self.num_blocks = num_blocks

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Blocks the host until the copy has landed."""
        if self.event is not None:
            self.event.synchronize()

    def order_before(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` (default: the current one) wait for this copy, without blocking."""
        if self.event is not None:
            (stream or torch.cuda.current_stream(self.event.device)).wait_event(self.event)


class CopyEngine:
    """Copies whole blocks between ``kv_caches`` (one tensor per layer) and ``slab`` slots.

    ``slab`` may be re-pointed in place (``set_``) at a new mapping, as the daemon client does
    when it maps the arena after a (re)connect; the engine reads it afresh for each transfer.
    """

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: Sequence[torch.Tensor],
        slab: torch.Tensor,
        counters: TierCounters | None = None,
    ):
        layout.check_tensors(kv_caches)
        if slab.dim() != 2 or slab.shape[1] != layout.block_bytes or slab.dtype != torch.uint8:
            raise ValueError(
                f"slab must be uint8 [slots, {layout.block_bytes}], got "
                f"{slab.dtype} {tuple(slab.shape)}"
            )
        self.layout = layout
        self.kv_caches = list(kv_caches)
        self.slab = slab
        self.device = kv_caches[0].device
        self.counters = counters
        self.on_cuda = self.device.type == "cuda"
        self._in_flight: deque[Transfer] = deque()
        self._events: list[torch.cuda.Event] = []
        if self.on_cuda:
            self._store_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def store(
        self, block_ids: Sequence[int], slots: Sequence[int], callback: Callback | None = None
    ) -> Transfer:
        """Copies GPU blocks into host slots, after all work already queued on the compute stream.

        ``callback`` runs once the bytes are in the slots (typically: commit them).
        """
        self._check(block_ids, slots)
        n = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.counters is not None:
            self.counters.bytes_out += n * self.layout.block_bytes
        if not self.on_cuda:
            staging = torch.empty((n, self.layout.block_bytes), dtype=torch.uint8)
            self.layout.gather(self.kv_caches, ids, staging)
            copy_rows(self.slab.numpy(), slots, staging.numpy(), range(n))
            return self._finish(Transfer(None, None, callback, n))
        stream = self._store_stream
        after_compute = self._record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            stream.wait_event(after_compute)
            staging = torch.empty(
                (n, self.layout.block_bytes), dtype=torch.uint8, device=self.device
            )
            self.layout.gather(self.kv_caches, ids, staging)
            for i, slot in enumerate(slots):
                self.slab[slot].copy_(staging[i], non_blocking=True)
            done = self._record(stream)
        self._events.append(after_compute)
        return self._track(Transfer(done, staging, callback, n))

    def load(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        after: Sequence[Transfer] = (),
        callback: Callback | None = None,
    ) -> Transfer:
        """Copies host slots into GPU blocks; the engine waits on the result before reading.

        The load waits for the compute stream's queued work and for ``after`` (spills still
        reading the old content of these blocks), so it never overwrites bytes in use.
        ``callback`` runs once the slots have been read (typically: release them).
        """
        self._check(block_ids, slots)
        n = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.counters is not None:
            self.counters.bytes_in += n * self.layout.block_bytes
        if not self.on_cuda:
            staging = torch.empty((n, self.layout.block_bytes), dtype=torch.uint8)
            copy_rows(staging.numpy(), range(n), self.slab.numpy(), slots)
            self.layout.scatter(staging, self.kv_caches, ids)
            return self._finish(Transfer(None, None, callback, n))
        stream = self._load_stream
        after_compute = self._record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            stream.wait_event(after_compute)
            for transfer in after:
                transfer.order_before(stream)
            staging = torch.empty(
                (n, self.layout.block_bytes), dtype=torch.uint8, device=self.device
            )
            for i, slot in enumerate(slots):
                staging[i].copy_(self.slab[slot], non_blocking=True)
            self.layout.scatter(staging, self.kv_caches, ids)
            done = self._record(stream)
        self._events.append(after_compute)
        return self._track(Transfer(done, staging, callback, n))

    def poll(self) -> int:
        """Runs the callbacks of transfers that have completed, in order; never blocks."""
        finished = 0
        while self._in_flight and self._in_flight[0].done():
            self._finish(self._in_flight.popleft())
            finished += 1
        return finished

    def synchronize(self) -> None:
        """Waits for every transfer in flight and runs its callback."""
        while self._in_flight:
            transfer = self._in_flight.popleft()
            transfer.wait()
            self._finish(transfer)

    def _check(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        if len(block_ids) != len(slots) or not block_ids:
            raise ValueError(
                f"need matching non-empty block ids and slots, got "
                f"{len(block_ids)} and {len(slots)}"
            )

    def _record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record(stream)
        return event

    def _track(self, transfer: Transfer) -> Transfer:
        self._in_flight.append(transfer)
        return transfer

    def _finish(self, transfer: Transfer) -> Transfer:
        """Runs a completed transfer's callback and lets its staging buffer go: blocks may
        keep the transfer as their ``pending_read`` long after, and must not pin GPU memory."""
        transfer._staging = None
        if transfer.callback is not None:
            callback, transfer.callback = transfer.callback, None
            callback()
        return transfer
