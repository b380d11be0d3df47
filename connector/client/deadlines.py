"""Deadlines for operations sent over a stream without waiting, whose answer someone polls.

A unary call ends at its deadline on its own (gRPC's); an operation over the slot channel or
the ``SlotOps`` stream ends only when its answer comes or the stream breaks, which a frozen
daemon delays without bound. A lookup the scheduler polls must end by its deadline as its call
would, a miss: ``Deadlines`` fails each operation it watches that is still unanswered then,
with ``DEADLINE_EXCEEDED``, from one thread of its own (started by the first it watches). An
answer that comes later finds the operation over and changes nothing.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import grpc

from kvtier.connector.client.slot_answers import OpFuture, StreamError


class Deadlines:
    def __init__(self) -> None:
        self._due: list[tuple[float, int, OpFuture, str]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, future: OpFuture, method: str, timeout: float) -> None:
        """Fails ``future`` (an operation ``method``) if it is unanswered ``timeout`` s on."""
        with self._changed:
            if self._closed:
                return
            due = (time.monotonic() + timeout, next(self._order), future, method)
            heapq.heappush(self._due, due)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._expire, name="kvtier-deadlines", daemon=True
                )
                self._thread.start()
            elif self._due[0] is due:
                self._changed.notify()  # else the thread already wakes before this one is due

    def close(self) -> None:
        """Stops watching; what is still watched is left to its stream's end."""
        with self._changed:
            self._closed = True
            thread, self._thread = self._thread, None
            self._changed.notify()
        if thread is not None:
            thread.join()

    def _expire(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (not self._due or self._due[0][0] > time.monotonic()):
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._closed:
                    return
                _, _, future, method = heapq.heappop(self._due)
            # outside the lock: the future's callbacks may send another operation to watch
            late = StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} missed its deadline")
            future.finish(error=late)
