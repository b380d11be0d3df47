"""How each call of the daemon's gRPC service is answered, and whom it comes from.

Refusals become status codes; every unary call is timed into the metrics; a call's peer is
the connection a session is bound to: a TCP peer as gRPC names it, or on the unix socket the
address the relay bound the connection to (``relay.unix``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from kvtier.service.arena import ArenaError
from kvtier.service.events import TooManyWatchers
from kvtier.service.rpc.handlers import Refused
from kvtier.service.rpc.wire import RequestError
from kvtier.service.session_errors import CallCancelled, OwnershipError, SessionError, SessionLimit
from kvtier.service.stats.metrics import Metrics
from kvtier.service.store import LayoutRefused

_CODES = {
    SessionError: grpc.StatusCode.NOT_FOUND,
    OwnershipError: grpc.StatusCode.PERMISSION_DENIED,
    LayoutRefused: grpc.StatusCode.FAILED_PRECONDITION,
    SessionLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooManyWatchers: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ArenaError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CallCancelled: grpc.StatusCode.CANCELLED,
}
REFUSALS = (RequestError, *_CODES)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a refusal is answered with."""
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    return _CODES[type(exc)], str(exc)


def session_peer(context: grpc.aio.ServicerContext) -> str:
    """The connection a session is bound to: a TCP peer, or the address the unix socket's
    relay bound the connection to (``relay.unix``); "" for an unbound unix peer."""
    peer = context.peer() or ""
    return peer if peer.startswith(("ipv4:", "ipv6:", "unix:/")) else ""


def log_source(peer: str) -> str:
    """Whom a refusal is logged against: a TCP peer's host without its port, and every unix
    peer as one (the daemon's own user), so that a client opening a new connection per call
    still gets one line per kind."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return "unix" if peer.startswith("unix:") else peer


class Answering(Protocol):
    """What a servicer gives ``unary``: where call times go, and how a refusal is logged."""

    metrics: Metrics

    def refused(
        self, context: grpc.aio.ServicerContext, exc: BaseException, message: str
    ) -> None: ...


Handler = Callable[[Answering, object, grpc.aio.ServicerContext], Awaitable[object]]


def unary(method: Handler) -> Handler:
    """Times the call, answers a refused request, and turns refusals into status codes."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Answering, request: object, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if isinstance(request, Refused):
                raise RequestError(request.code, request.message, request.kind)
            return await method(self, request, context)
        except REFUSALS as exc:
            code, message = status_of(exc)
            self.refused(context, exc, message)
            await context.abort(code, message)
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            self.metrics.observe(name, code.name, time.perf_counter() - start)

    return wrapper
