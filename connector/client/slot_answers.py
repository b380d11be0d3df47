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
    """An operation's answer to come; offers what ``LaterCalls`` uses of a ``grpc.Future``."""

    __slots__ = ("_callbacks", "_cancelled", "_done", "_error", "_lock", "_reply")

    def __init__(self):
        self._done = threading.Event()
        self._reply = None
        self._error: grpc.RpcError | None = None
        self._callbacks: list[Callable[[OpFuture], None]] = []
        self._lock = threading.Lock()
        self._cancelled = False

    def cancelled(self) -> bool:
        """True if the client closed the stream under it (it stopped waiting itself)."""
        return self._cancelled

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._error is not None:
            raise self._error
        return self._reply

    def exception(self, timeout: float | None = None) -> grpc.RpcError | None:
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        return self._error

    def add_done_callback(self, callback: Callable[[OpFuture], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def finish(
        self, reply: object = None, error: grpc.RpcError | None = None, cancelled: bool = False
    ) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._reply, self._error, self._cancelled = reply, error, cancelled
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
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
