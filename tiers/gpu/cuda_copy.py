"""Block copies on a CUDA device: DMA on side streams, ordered by events, never a host sync.

In the canonical page order (``BLHNC``) a block is one contiguous run of the KV buffer, so a
store or load is a handful of ``cudaMemcpyAsync`` between vLLM's buffer and the pinned slab
(consecutive blocks into consecutive slots merge into one): no kernel, no staging. The copies
are queued through the runtime library directly (``runtime.copy_runs``), which costs the
engine's thread a tenth of what a ``Tensor.copy_`` per run does. Any other order goes through
a FIXED staging ring per direction, allocated once: chunk ``k`` is gathered (or scattered) by
one indexing kernel on a high-priority kernel stream (so that the forward's kernels do not
hold up the pipeline) while the DMA stream moves chunk ``k - 1``, and a ring slot is
rewritten only after the event of its last reader.

Nothing a stream reads is freed under it: the KV buffer and the ring live as long as the
copier, and a transfer owns the pinned buffer its block ids travel in until its last event.
The engine's thread only queues work: ids go to the device from pinned memory with
``non_blocking``, every wait is a stream waiting on an event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.gpu.plan import chunk_ranges, plan_runs
from kvtier.tiers.gpu.runtime import copy_runs, runtime
from kvtier.tiers.tunables import TUNABLES

logger = logging.getLogger(__name__)

STORE, LOAD = "store", "load"
_HIGH_PRIORITY = -1
"""Stream priority of the ring's gather and scatter kernels (lower is sooner)."""


class StagingRing:
    """``slots`` device buffers of ``slot_blocks`` canonical rows, and one device buffer for a
    whole transfer's block ids (at most every block once).

    The ids go to the device in one copy before the first chunk: a copy per chunk, queued
    after the previous chunk had landed, waited behind the next chunk's DMA in the same
    direction and held up the pipeline.
    """

    def __init__(self, placement: KVPlacement, nbytes: int, slots: int = 2):
        block_bytes = placement.layout.block_bytes
        self.slot_blocks = max(nbytes // slots // block_bytes, 1)
        device = placement.device
        self.rows = [
            torch.zeros((self.slot_blocks, block_bytes), dtype=torch.uint8, device=device)
            for _ in range(slots)
        ]
        self.ids = torch.empty(placement.num_blocks, dtype=torch.long, device=device)
        self.released: list[torch.cuda.Event | None] = [None] * slots
        """Per slot, the event after which its last reader is done (None: never used)."""
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(r.numel() for r in self.rows) + self.ids.numel() * 8

    def load_ids(self, ids: torch.Tensor, count: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """Queues the first ``count`` of pinned ``ids`` to the device on ``stream``, the stream of
        every reader of the device buffer (so no earlier transfer still reads what it
        overwrites); returns them on the device."""
        if count > self.ids.numel():
            raise ValueError(f"{count} blocks in one transfer, but the KV holds {self.ids.numel()}")
        with torch.cuda.stream(stream):
            return self.ids[:count].copy_(ids[:count], non_blocking=True)

    def take(self) -> int:
        """The next slot in turn."""
        slot = self._next
        self._next = (slot + 1) % len(self.rows)
        return slot


class PinnedIds:
    """Reusable pinned int64 host buffers that carry block ids to the device.

    ``ready`` buffers of ``capacity`` ids are allocated up front: a page-locked allocation is
    a CUDA call that may synchronize, not something for the engine's step.
    """

    def __init__(self, pin: bool = True, ready: int = 0, capacity: int = 256):
        self._pin = pin
        self._free = [torch.empty(capacity, dtype=torch.long, pin_memory=pin) for _ in range(ready)]
        # stores take buffers on the submitter's thread, loads on the engine's
        self._lock = threading.Lock()

    def take(self, values: Sequence[int]) -> torch.Tensor:
        """A buffer holding ``values`` (first ``len(values)`` entries); give it back when done."""
        n = len(values)
        with self._lock:
            fits = next((i for i, b in enumerate(self._free) if b.numel() >= n), None)
            buf = None if fits is None else self._free.pop(fits)
        if buf is None:
            buf = torch.empty(max(n, 256), dtype=torch.long, pin_memory=self._pin)
        buf.numpy()[:n] = values
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class CudaCopier:
    """Streams, ring and id buffers of one engine's KV buffer on one device."""

    def __init__(self, placement: KVPlacement, staging_bytes: int):
        self.placement = placement
        self.device = placement.device
        # ids travel only through the ring; a transfer names at most every block once
        ready = 0 if placement.block_contiguous else TUNABLES.ring_id_buffers
        self.ids = PinnedIds(ready=ready, capacity=placement.num_blocks)
        self._runtime = runtime()
        self._dma = {d: torch.cuda.Stream(self.device) for d in (STORE, LOAD)}
        self._kernels: dict[str, torch.cuda.Stream] = {}
        self._rings: dict[str, StagingRing] = {}
        if not placement.block_contiguous:
            self._kernels = {
                d: torch.cuda.Stream(self.device, priority=_HIGH_PRIORITY) for d in (STORE, LOAD)
            }
            self._rings = {d: StagingRing(placement, staging_bytes // 2) for d in (STORE, LOAD)}

    @property
    def staging_bytes(self) -> int:
        return sum(ring.nbytes for ring in self._rings.values())

    def mark(self) -> torch.cuda.Event:
        """An event after the work queued so far on the calling thread's compute stream."""
        return _record(torch.cuda.current_stream(self.device))

    def store(
        self,
        block_ids: Sequence[int],
        slots: Sequence[int],
        slab: torch.Tensor,
        host_boundary: int,
        ready: torch.cuda.Event,
    ) -> tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor | None]:
        """Queues GPU blocks -> slots after ``ready`` (a ``mark`` of the compute stream); any
        thread may call it.

        Returns (start event, done event, pinned ids the transfer owns until done).
        """
        host = slab.view(-1)
        block_bytes = self.placement.layout.block_bytes
        if not self._rings:
            stream = self._dma[STORE]
            stream.wait_event(ready)
            runs = self.placement.block_runs(block_ids, slots, host_boundary)
            # every call below names its stream: no current-stream switch on the engine's thread
            start = _record(stream, timing=True)
            copy_runs(self._runtime, stream, host, self.placement.buffer, runs, to_host=True)
            return start, _record(stream, timing=True), None
        ids = self.ids.take(block_ids)
        ring, kernels, dma = self._rings[STORE], self._kernels[STORE], self._dma[STORE]
        dev_ids = ring.load_ids(ids, len(block_ids), kernels)
        kernels.wait_event(ready)
        start = _record(kernels, timing=True)
        for chunk in chunk_ranges(len(block_ids), ring.slot_blocks):
            k, m = ring.take(), len(chunk)
            with torch.cuda.stream(kernels):
                if ring.released[k] is not None:
                    kernels.wait_event(ring.released[k])
                self.placement.gather(dev_ids[chunk.start : chunk.stop], ring.rows[k][:m])
                gathered = _record(kernels)
            with torch.cuda.stream(dma):
                dma.wait_event(gathered)
                runs = plan_runs(
                    [i * block_bytes for i in range(m)],
                    [s * block_bytes for s in slots[chunk.start : chunk.stop]],
                    block_bytes,
                    host_boundary,
                )
                copy_runs(self._runtime, dma, host, ring.rows[k].view(-1), runs, to_host=True)
                ring.released[k] = _record(dma, timing=True)
        return start, ring.released[k], ids

    def load(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        slab: torch.Tensor,
        host_boundary: int,
        after: Sequence[torch.cuda.Event],
    ) -> tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor | None]:
        """Queues slots -> GPU blocks after the compute stream's queued work and ``after``."""
        compute = torch.cuda.current_stream(self.device)
        host = slab.view(-1)
        block_bytes = self.placement.layout.block_bytes
        dma = self._dma[LOAD]
        dma.wait_stream(compute)
        for event in after:
            dma.wait_event(event)
        if not self._rings:
            runs = self.placement.block_runs(block_ids, slots, host_boundary)
            start = _record(dma, timing=True)
            copy_runs(self._runtime, dma, host, self.placement.buffer, runs, to_host=False)
            return start, _record(dma, timing=True), None
        ids = self.ids.take(block_ids)
        ring, kernels = self._rings[LOAD], self._kernels[LOAD]
        dev_ids = ring.load_ids(ids, len(block_ids), kernels)
        start = _record(dma, timing=True)
        for chunk in chunk_ranges(len(block_ids), ring.slot_blocks):
            k, m = ring.take(), len(chunk)
            with torch.cuda.stream(dma):
                if ring.released[k] is not None:
                    dma.wait_event(ring.released[k])
                runs = plan_runs(
                    [i * block_bytes for i in range(m)],
                    [s * block_bytes for s in slots[chunk.start : chunk.stop]],
                    block_bytes,
                    host_boundary,
                )
                copy_runs(self._runtime, dma, host, ring.rows[k].view(-1), runs, to_host=False)
                landed = _record(dma)
            with torch.cuda.stream(kernels):
                kernels.wait_event(landed)
                self.placement.scatter(ring.rows[k][:m], dev_ids[chunk.start : chunk.stop])
                ring.released[k] = _record(kernels, timing=True)
        return start, ring.released[k], ids


def _record(stream: torch.cuda.Stream, timing: bool = False) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event
