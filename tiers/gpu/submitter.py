"""A thread that queues a CUDA engine's stores, so that the engine's thread only hands them off.

Queuing a 32-block store costs the thread that does it 0.13 to 0.3 ms on an H200's host: planning
the runs, two events, the stream's wait, and ``cudaMemcpyBatchAsync``, most of it in the
driver. vLLM calls the worker's store on the engine's thread, between two steps. So that
thread only records an event on its compute stream, which fixes what the store copies (the
work queued before it), and puts the store here; this thread makes the store stream wait for
that event and queues the copies. The bytes are the same either way: a store's blocks are not
rewritten before its transfer is done, and a transfer is not done before its copies are
queued. Whoever must order work after a store (``Transfer.order_before``, a load's ``after``)
first waits for its copies to be queued, which is seldom and short.

A failure while queuing (a CUDA error, say) is raised on the engine's thread by the next call
that finishes, waits for or orders after that transfer, as CUDA reports asynchronous errors.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from kvtier.tiers.gpu.transfer import Callback, Transfer

QueueCopies = Callable[[], tuple[torch.cuda.Event, torch.cuda.Event, Callback | None]]
"""Queues a transfer's copies; returns its start and done events and what hands back its ids."""


class StoreSubmitter:
    """One thread per copy engine; stores are queued in the order they were handed off."""

    def __init__(self, device_index: int | None):
        """``device_index``: the CUDA device this thread acts on (None: leave it as it is)."""
        self._work: queue.SimpleQueue[tuple[Transfer, QueueCopies] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(device_index,), name="kvtier-store-queue", daemon=True
        )
        self._thread.start()

    def submit(self, transfer: Transfer, queue_copies: QueueCopies) -> Transfer:
        """Hands ``transfer`` off; ``queue_copies`` runs on this submitter's thread."""
        transfer.hand_off()
        self._work.put((transfer, queue_copies))
        return transfer

    def close(self) -> None:
        """Queues what was handed off, then ends the thread."""
        self._work.put(None)
        self._thread.join()

    def _run(self, device_index: int | None) -> None:
        if device_index is not None:
            # the runtime's calls through ctypes act on the calling thread's current device
            torch.cuda.set_device(device_index)
        while (item := self._work.get()) is not None:
            transfer, queue_copies = item
            try:
                transfer.queued(*queue_copies())
            except BaseException as exc:  # handed to the engine's thread, never lost here
                transfer.failed(exc)
