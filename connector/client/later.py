"""Calls the daemon client sends without waiting: Release, Abort, the Cancel that repairs a
failed Reserve or Acquire, and a Commit whose caller does not wait (``commit``).

Their answers matter only to the next Reserve or Acquire, which must see the room they made:
it waits for those it does not follow on the same stream (``settle_for_next``). A release or
abort the daemon never confirms leaves its view of those slots unknown, so that failure gives
the session up; a Cancel that fails does too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import grpc

from kvtier.connector.client.circuit import CircuitBreaker
from kvtier.connector.client.slot_stream import SlotCalls
from kvtier.connector.tunables import TUNABLES
from kvtier.proto import kvtier_pb2 as pb

Failed = Callable[..., None]
"""Counts a failed call of this method on this session, and repairs what it may have changed
(the client's ``_failed(method, error, session, repair=None)``)."""
GiveUp = Callable[[str, str], None]
"""Ends this session, saying why (``SessionKeeper.give_up``)."""


class LaterCalls:
    """The calls sent without waiting that the daemon has not answered yet."""

    def __init__(
        self,
        calls: SlotCalls,
        lock: threading.Lock,
        breaker: CircuitBreaker,
        *,
        timeout_s: float,
        failed: Failed,
        give_up: GiveUp,
    ):
        self._calls = calls
        self._lock = lock
        self._breaker = breaker
        self._timeout = max(TUNABLES.repair_timeout_s, timeout_s)
        self._failed = failed
        self._give_up = give_up
        self._unsettled: list = []
        """grpc.Future or OpFuture: the calls not answered yet."""

    def send(
        self, method: str, session: str, slots: Sequence[int], tolerate_gone: bool = False
    ) -> None:
        """Sends a Release or Abort; a failure gives the session up, since the daemon's view
        of these slots is then unknown. ``tolerate_gone``: the slots may be committed already
        (an abort repairing a commit), which is fine."""
        request = pb.SlotsRequest(session_id=session, slots=slots)
        future = self._calls.future(method, request, self._timeout)

        def settled(future: grpc.Future) -> None:
            self._forget(future)
            if future.cancelled():
                return
            exc = future.exception()
            if exc is None:
                return
            if tolerate_gone and exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                return
            self._failed(method, exc, session)
            self._give_up(session, f"{method} failed ({exc.code().name})")

        self._track(future, settled)

    def commit(
        self, session: str, request: pb.SlotsRequest, then: Callable[[bool, int], None]
    ) -> None:
        """Sends a Commit; ``then(ok, not_stored)`` once it is answered. A failed one's slots
        are aborted (a late commit may have landed after all: its abort is then refused,
        which is as good)."""
        future = self._calls.future("Commit", request, self._timeout, polled=True)

        def settled(future) -> None:
            self._forget(future)
            exc = None if future.cancelled() else future.exception()
            if exc is None and not future.cancelled():
                then(True, future.result().not_stored)
                return
            if exc is not None:
                repair = partial(self.send, "Abort", session, list(request.slots), True)
                self._failed("Commit", exc, session, repair=repair)
            then(False, 0)

        self._track(future, settled)

    def canceller(self, session: str, call_id: int) -> Callable[[], None]:
        """A repair for a Reserve or Acquire that failed: cancel it on the daemon."""

        def cancel() -> None:
            request = pb.CancelRequest(session_id=session, call_id=call_id)
            future = self._calls.future("Cancel", request, self._timeout)

            def settled(future: grpc.Future) -> None:
                self._forget(future)
                if not future.cancelled() and future.exception() is not None:
                    code = future.exception().code().name
                    self._give_up(session, f"Cancel failed ({code})")

            self._track(future, settled)

        return cancel

    def settle(self, timeout: float | None = None) -> bool:
        """Waits until the daemon has answered every call sent so far; False (and the
        breaker opened) if it has not within ``timeout``. Failures are handled by the calls'
        own callbacks."""
        with self._lock:
            pending = list(self._unsettled)
        return self._wait(pending, timeout)

    def settle_for_next(self, timeout: float | None = None) -> bool:
        """``settle``, for the calls the next operation would not see done otherwise: not
        those it goes behind on the same stream (``SlotCalls.ordered_before_next``). On the
        slot channel a Reserve right after a Release goes out at once, not a round trip
        later."""
        with self._lock:
            pending = list(self._unsettled)
        return self._wait([f for f in pending if not self._calls.ordered_before_next(f)], timeout)

    def _wait(self, pending: list, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(timeout=left)
            except grpc.FutureTimeoutError:
                self._breaker.trip("releases or aborts unanswered")
                return False
            except (grpc.RpcError, grpc.FutureCancelledError):
                pass
        return True

    def _track(self, future: grpc.Future, settled: Callable[[grpc.Future], None]) -> None:
        with self._lock:
            self._unsettled.append(future)
        future.add_done_callback(settled)

    def _forget(self, future: grpc.Future) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._unsettled.remove(future)
