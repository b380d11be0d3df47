"""A batch of block copies in flight, and the queues that complete them in order per stream.

A transfer owns everything a stream still reads for it (a pinned buffer of block ids) until
its last event has completed; only then does ``finish`` hand those back and run its callback.
Stores and loads complete independently: a finished load never waits behind a larger store
queued before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

Callback = Callable[[], None]


class Transfer:
    """One batch of block copies; done at once on a CPU."""

    __slots__ = ("_release", "callback", "done_event", "num_blocks", "num_bytes", "start_event")

    def __init__(
        self,
        num_blocks: int,
        num_bytes: int,
        callback: Callback | None = None,
        start_event: torch.cuda.Event | None = None,
        done_event: torch.cuda.Event | None = None,
        release: Callback | None = None,
    ):
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.callback = callback
        self.start_event = start_event
        self.done_event = done_event
        self._release = release

    def done(self) -> bool:
        """True once every copy has landed; never blocks."""
        return self.done_event is None or self.done_event.query()

    def wait(self) -> None:
        """Blocks the host until the copy has landed (shutdown and tests; never the step)."""
        if self.done_event is not None:
            self.done_event.synchronize()

    def order_before(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` (default: the current one) wait for this copy, without blocking."""
        if self.done_event is not None:
            (stream or torch.cuda.current_stream(self.done_event.device)).wait_event(
                self.done_event
            )

    def elapsed_s(self) -> float | None:
        """Seconds between the copy's first and last byte on its stream, once done."""
        if self.start_event is None or self.done_event is None or not self.done():
            return None
        return self.start_event.elapsed_time(self.done_event) / 1000

    def finish(self) -> None:
        """Hands back what the streams read and runs the callback; call once, when done."""
        if self._release is not None:
            release, self._release = self._release, None
            release()
        if self.callback is not None:
            callback, self.callback = self.callback, None
            callback()


class CompletionQueue:
    """Transfers of ONE stream, completed strictly in the order they were queued."""

    def __init__(self) -> None:
        self._queue: deque[Transfer] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, transfer: Transfer) -> Transfer:
        self._queue.append(transfer)
        return transfer

    def poll(self) -> int:
        """Finishes the leading transfers that are done; never blocks."""
        finished = 0
        while self._queue and self._queue[0].done():
            self._queue.popleft().finish()
            finished += 1
        return finished

    def drain(self) -> None:
        """Waits for every transfer in turn and finishes it."""
        while self._queue:
            transfer = self._queue.popleft()
            transfer.wait()
            transfer.finish()
