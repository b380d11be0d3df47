"""Block copies between an engine's KV buffer and host slots, on any device.

``CopyEngine`` is the one path every GPU-side user takes (the reference engine's pool, the
fall-through walk, the vLLM connector's worker). A store copies blocks into slots after the
work already queued on the compute stream; a load copies slots into blocks and hands back a
``Transfer`` whose event the engine waits on before attention reads them. On CUDA the copies
run on side streams (``cuda_copy``), on a CPU synchronously (``cpu_copy``); the planning is
the same (``plan``). A CUDA store is handed off at once: the engine's thread fixes what it
copies, a thread of the engine's own queues the copies (``submitter``).

The engine locks (``cudaHostRegister``) the slab it copies through on first use, on the
calling (engine) thread and under the KV buffer's device, unless the slab's owner locks it
(``lock_host=False``: the daemon client locks each mapping on its own thread). The slab tensor
may be re-pointed (``set_``) at a new mapping between transfers, as the daemon client does
when the daemon restarts; the engine reads it afresh for every transfer, unlocks the old
mapping and locks the new one. Completed transfers run their callbacks (commit the stored
slots, release the read ones) from ``poll()``, which never blocks, in order per direction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.gpu import cpu_copy
from kvtier.tiers.gpu.pinned import (
    MAX_REGISTER_BYTES,
    is_registered,
    register_host,
    registration_chunk,
    unregister_host,
)
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.gpu.plan import check_pairs
from kvtier.tiers.gpu.submitter import StoreSubmitter
from kvtier.tiers.gpu.transfer import Callback, CompletionQueue, Transfer
from kvtier.tiers.tunables import TUNABLES

logger = logging.getLogger(__name__)


class CopyEngine:
    """Copies whole blocks between ``placement``'s KV buffer and the rows of ``slab``."""

    def __init__(
        self,
        placement: KVPlacement,
        slab: torch.Tensor,
        *,
        counters: TierCounters | None = None,
        staging_bytes: int = TUNABLES.staging_bytes,
        lock_host: bool = True,
    ):
        block_bytes = placement.layout.block_bytes
        if slab.dim() != 2 or slab.shape[1] != block_bytes or slab.dtype != torch.uint8:
            raise ValueError(
                f"slab must be uint8 [slots, {block_bytes}], got {slab.dtype} {tuple(slab.shape)}"
            )
        self.placement = placement
        self.layout = placement.layout
        self.slab = slab
        self.counters = counters
        self.device = placement.device
        self.on_cuda = self.device.type == "cuda"
        self.host_pinned = False
        """Whether the slab is page-locked (on CUDA; a pageable slab makes copies synchronous)."""
        self._lock_host = lock_host
        self._mapping: int | None = None  # address of the slab mapping last prepared
        self._locked = False  # whether this engine locked that mapping (and must unlock it)
        self._stores = CompletionQueue()
        self._loads = CompletionQueue()
        self._cuda = None
        self._submitter: StoreSubmitter | None = None  # started by the first store on CUDA
        if self.on_cuda:
            from kvtier.tiers.gpu.cuda_copy import CudaCopier

            self._cuda = CudaCopier(placement, staging_bytes)
            self.prepare_host()
        logger.info(
            "kvtier copy engine on %s: %d-byte blocks, %s, %d bytes of GPU staging",
            self.device,
            block_bytes,
            "one run per block" if placement.block_contiguous else "gathered through a ring",
            self.staging_bytes,
        )

    @property
    def staging_bytes(self) -> int:
        """GPU bytes this engine allocated for staging (fixed for its lifetime)."""
        return self._cuda.staging_bytes if self._cuda is not None else 0

    @property
    def in_flight(self) -> int:
        return len(self._stores) + len(self._loads)

    def prepare_host(self) -> bool:
        """Locks the slab's current mapping if it is new; True if it is page-locked.

        Runs on the caller's (engine) thread; every transfer calls it first, so a slab
        re-pointed at a new mapping is locked before a copy touches it.
        """
        if not self.on_cuda:
            return False
        if not self._lock_host:
            self.host_pinned = is_registered(self.slab)
            return self.host_pinned
        ptr = self.slab.data_ptr()
        if self.slab.numel() == 0 or ptr == self._mapping:
            return self.host_pinned  # a mapping that could not be locked is not tried again
        for transfer in self._stores:  # none is left to queue into the mapping unlocked below
            transfer.await_queued()
        self.release_host()
        self._mapping = ptr
        if is_registered(self.slab):
            self.host_pinned = True  # locked by its owner, who also unlocks it
            return True
        self._locked = register_host(self.slab, self.device, self.layout.block_bytes)
        self.host_pinned = self._locked
        return self.host_pinned

    def release_host(self) -> None:
        """Unlocks the mapping this engine locked (after its copies have landed)."""
        if self._locked and self._mapping is not None:
            unregister_host(self._mapping, self.device)
        self._mapping = None
        self._locked = False
        self.host_pinned = False

    def store(
        self, block_ids: Sequence[int], slots: Sequence[int], callback: Callback | None = None
    ) -> Transfer:
        """Copies blocks into host slots, after all work already queued on the compute stream.

        ``callback`` runs once the bytes are in the slots (typically: commit them).
        """
        self._check(block_ids, slots)
        n, nbytes = len(block_ids), len(block_ids) * self.layout.block_bytes
        if self.counters is not None:
            self.counters.bytes_out += nbytes
        if self._cuda is None:
            if self.placement.block_contiguous:
                runs = self.placement.block_runs(block_ids, slots)
                cpu_copy.store_runs(self.placement, self.slab, runs)
            else:
                cpu_copy.store_rows(self.placement, self.slab, block_ids, slots)
            return self._done_at_once(Transfer(n, nbytes, callback))
        self.prepare_host()
        # what the copy reads is fixed here, on the engine's thread: the compute stream's work
        # so far, the slab's mapping now; the submitter's thread queues the copies
        ready, host, boundary = self._cuda.mark(), self.slab.view(-1), self._boundary()
        block_ids, slots = list(block_ids), list(slots)

        def queue_copies():
            start, done, ids = self._cuda.store(block_ids, slots, host, boundary, ready)
            return start, done, self._give_back(ids)

        if self._submitter is None:
            index = self.device.index
            if index is None:
                index = torch.cuda.current_device()
            self._submitter = StoreSubmitter(index)
        transfer = self._submitter.submit(Transfer(n, nbytes, callback), queue_copies)
        return self._stores.push(transfer)

    def load(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        after: Sequence[Transfer] = (),
        callback: Callback | None = None,
    ) -> Transfer:
        """Copies host slots into blocks; the engine orders its reads after the result.

        The load waits for the compute stream's queued work and for ``after`` (copies still
        reading these blocks' old content), so it never overwrites bytes in use.
        ``callback`` runs once the slots have been read (typically: release them).
        """
        self._check(block_ids, slots)
        n, nbytes = len(block_ids), len(block_ids) * self.layout.block_bytes
        if self.counters is not None:
            self.counters.bytes_in += nbytes
        if self._cuda is None:
            if self.placement.block_contiguous:
                runs = self.placement.block_runs(block_ids, slots)
                cpu_copy.load_runs(self.placement, self.slab, runs)
            else:
                cpu_copy.load_rows(self.placement, self.slab, slots, block_ids)
            return self._done_at_once(Transfer(n, nbytes, callback))
        self.prepare_host()
        for transfer in after:
            transfer.await_queued()
        waits = [t.done_event for t in after if t.done_event is not None]
        start, done, ids = self._cuda.load(slots, block_ids, self.slab, self._boundary(), waits)
        return self._loads.push(Transfer(n, nbytes, callback, start, done, self._give_back(ids)))

    def poll(self) -> int:
        """Finishes the transfers that have landed, in order per direction; never blocks."""
        return self._loads.poll() + self._stores.poll()

    def synchronize(self) -> None:
        """Waits for every transfer in flight and finishes it."""
        self._loads.drain()
        self._stores.drain()

    def close(self) -> None:
        """Lets every copy land, then unlocks the slab mapping this engine locked."""
        self.synchronize()
        if self._submitter is not None:
            self._submitter.close()
            self._submitter = None
        self.release_host()

    # ---- internals ----

    def _check(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        check_pairs(block_ids, slots, self.placement.num_blocks, self.slab.shape[0])

    def _boundary(self) -> int:
        """Host bytes no single copy may cross: the slab's registration chunks, if several."""
        if self.slab.numel() <= MAX_REGISTER_BYTES:
            return 0
        return registration_chunk(self.layout.block_bytes)

    def _give_back(self, ids: torch.Tensor | None) -> Callback | None:
        if ids is None:
            return None
        pool = self._cuda.ids
        return lambda: pool.give(ids)

    @staticmethod
    def _done_at_once(transfer: Transfer) -> Transfer:
        transfer.finish()
        return transfer
