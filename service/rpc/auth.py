"""The shared-token check for the TCP listener.

A unix socket is guarded by its file mode; a TCP port is not, so every call on it must carry
``authorization: Bearer <token>`` metadata. Refused calls get ``UNAUTHENTICATED``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

from kvtier.proto.contract import TOKEN_METADATA_KEY


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call only if its metadata carries the shared token."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty token would admit anyone")
        self._expected = f"Bearer {token}".encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return await continuation(handler_call_details)
        return self._deny


async def _deny(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
