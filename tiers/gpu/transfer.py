"""A batch of block copies in flight, and the queues that complete them in order per stream.

A transfer owns everything a stream still reads for it (a pinned buffer of block ids) until
its last event has completed; only then does ``finish`` hand those back and run its callback.
Stores and loads complete independently: a finished load never waits behind a larger store
queued before it. A transfer handed off to another thread (``submitter``) is not done, and
has no events to wait on, until that thread has queued its copies.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

import torch

Callback = Callable[[], None]


class Transfer:
    """One batch of block copies; done at once on a CPU."""

    __slots__ = (
        "_error",
        "_queued",
        "_release",
        "callback",
        "done_event",
        "num_blocks",
        "num_bytes",
        "start_event",
    )

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
        self._queued: threading.Event | None = None
        self._error: BaseException | None = None

    def hand_off(self) -> None:
        """Marks the copies as queued later, by another thread (``queued`` or ``failed``)."""
        self._queued = threading.Event()

    def queued(
        self, start: torch.cuda.Event, done: torch.cuda.Event, release: Callback | None
    ) -> None:
        """The other thread has queued the copies: their events and what to hand back."""
        self.start_event, self.done_event, self._release = start, done, release
        self._queued.set()

    def failed(self, error: BaseException) -> None:
        """The other thread could not queue the copies; ``error`` is raised to the waiter."""
        self._error = error
        self._queued.set()

    def await_queued(self) -> None:
        """Returns once the copies are on their streams (at once unless handed off); raises
        what queuing them raised."""
        if self._queued is not None:
            self._queued.wait()
            if self._error is not None:
                raise self._error

    def done(self) -> bool:
        """True once every copy has landed; never blocks."""
        if self._queued is not None:
            if not self._queued.is_set():
                return False
            if self._error is not None:
                raise self._error
        return self.done_event is None or self.done_event.query()

    def wait(self) -> None:
        """Blocks the host until the copy has landed (shutdown and tests; never the step)."""
        self.await_queued()
        if self.done_event is not None:
            self.done_event.synchronize()

    def order_before(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` (default: the current one) wait for this copy; blocks only while
        a handed-off copy is not yet queued."""
        self.await_queued()
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

    def __iter__(self) -> Iterator[Transfer]:
        return iter(self._queue)

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
