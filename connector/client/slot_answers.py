"""How a slot operation's answer reaches its caller, whichever way the operation went: over
the ``SlotOps`` stream (``slot_stream``) or the slot channel (``slot_channel``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import grpc

from kvtier.proto import kvtier_pb2 as pb

OP_FIELDS = {
    "Reserve": ("reserve", "reserve"),
    "Commit": ("commit", "slots"),
    "Abort": ("abort", "slots"),
    "Acquire": ("acquire", "acquire"),
    "Release": ("release", "slots"),
    "Cancel": ("cancel", "cancel"),
    "Lookup": ("lookup", "lookup"),
}
"""Method -> (its field in ``SlotOp``, the field of ``SlotResult`` that holds its reply)."""
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamError(grpc.RpcError):
    """An operation's failure over the stream, shaped as its unary call's would be."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class OpFuture:
    """An operation's answer to come; offers what ``LaterCalls`` uses of a ``grpc.Future``.

    A waiter blocks on one lock that ``finish`` releases once (each waiter lets the next
    through), not on an ``Event``: an event's waiter wakes only to wait again for the lock
    of the condition its setter still holds, a second hand-off between the two threads on
    every answer."""

    __slots__ = (
        "_callbacks",
        "_cancelled",
        "_done",
        "_error",
        "_lock",
        "_reply",
        "_waiter",
        "carrier",
    )

    def __init__(self, carrier: PendingOps | None = None):
        self.carrier = carrier
        """The ``PendingOps`` of the stream or channel the operation went over."""
        self._waiter = threading.Lock()
        self._waiter.acquire()  # held until ``finish``
        self._done = False
        self._reply = None
        self._error: grpc.RpcError | None = None
        self._callbacks: list[Callable[[OpFuture], None]] = []
        self._lock = threading.Lock()
        self._cancelled = False

    def cancelled(self) -> bool:
        """True if the client closed the stream under it (it stopped waiting itself)."""
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Stops waiting for the answer, as a cancelled call does; False if it came already."""
        if self._done:
            return False
        self.finish(error=StreamError(grpc.StatusCode.CANCELLED, "cancelled"), cancelled=True)
        return True

    def result(self, timeout: float | None = None):
        if not self._wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._error is not None:
            raise self._error
        return self._reply

    def exception(self, timeout: float | None = None) -> grpc.RpcError | None:
        if not self._wait(timeout):
            raise grpc.FutureTimeoutError()
        return self._error

    def _wait(self, timeout: float | None) -> bool:
        """Whether the answer came within ``timeout`` seconds (None: however long)."""
        if self._done:
            return True
        if self._waiter.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._waiter.release()
            return True
        return self._done

    def add_done_callback(self, callback: Callable[[OpFuture], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def finish(
        self, reply: object = None, error: grpc.RpcError | None = None, cancelled: bool = False
    ) -> None:
        with self._lock:
            if self._done:
                return
            self._reply, self._error, self._cancelled = reply, error, cancelled
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        self._waiter.release()
        for callback in callbacks:
            callback(self)


class PendingOp(NamedTuple):
    """An operation on the stream, waiting for its answer."""

    future: OpFuture
    method: str
    request: object
    timeout: float
    """What its unary call would be given, should it have to go as one."""


def code_of(value: int) -> grpc.StatusCode:
    """The status code a result's ``code`` field names (an unknown number: ``UNKNOWN``)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def answer(result: pb.SlotResult, future: OpFuture, method: str) -> None:
    """Finishes ``future`` with ``result``: the reply, or the error its unary call would raise."""
    if result.code:
        future.finish(error=StreamError(code_of(result.code), result.message))
    else:
        future.finish(getattr(result, OP_FIELDS[method][1]))


class PendingOps:
    """The operations one stream or channel carries that wait for their answers, until it
    breaks: then ``broken`` holds why, and it takes no more."""

    def __init__(self) -> None:
        self.broken: grpc.RpcError | None = None
        self._ops: dict[int, PendingOp] = {}
        self._lock = threading.Lock()

    def add(self, op_id: int, method: str, request, timeout: float) -> OpFuture | None:
        """Waits for an operation's answer; None if already broken (the caller goes another
        way)."""
        op = PendingOp(OpFuture(self), method, request, timeout)
        with self._lock:
            if self.broken is not None:
                return None
            self._ops[op_id] = op
        return op.future

    def forget(self, op_id: int) -> None:
        """Stops waiting for an operation (its caller's deadline passed)."""
        with self._lock:
            self._ops.pop(op_id, None)

    def answer(self, result: pb.SlotResult) -> None:
        """Hands ``result`` to the operation waiting for its id, if one still does."""
        with self._lock:
            waiting = self._ops.pop(result.op_id, None)
        if waiting is not None:
            answer(result, waiting.future, waiting.method)

    def end(self, error: grpc.RpcError) -> list[PendingOp]:
        """Marks the stream broken with ``error``; returns the operations still waiting, for
        the caller to finish."""
        with self._lock:
            self.broken = error
            ops, self._ops = list(self._ops.values()), {}
        return ops
