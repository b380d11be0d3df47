"""Registers the servicer's methods with gRPC behind guarded request decoders.

gRPC's generated registration decodes every request with no bound but the server-wide message
size (which a ``Put`` of one large block needs high), and logs a full traceback for each
undecodable one. Here each method gets its own size bound, checked before decoding, and a
request that is too large or undecodable reaches the servicer as a ``Refused`` value, which it
answers with a status (``RESOURCE_EXHAUSTED`` or ``INVALID_ARGUMENT``) and one log line per
peer and kind of trouble, rate-limited.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import HASH_BYTES, MAX_HASHES, MAX_MESSAGE_BYTES, SLOT_BATCH_BYTES
from kvtier.service.tunables import TUNABLES

SERVICE = pb.DESCRIPTOR.services_by_name["KvTier"]

_HASHES = MAX_HASHES * HASH_BYTES + (64 << 10)
_SLOTS = MAX_HASHES * 6 + (64 << 10)
RESERVE_META_BYTES = 32 << 20
"""Most engine metadata bytes one ``Reserve``, or a ``Commit`` naming its slots, may carry
(clients split larger batches)."""
REQUEST_LIMITS = {
    "Lookup": _HASHES,
    "Acquire": _HASHES,
    "Get": _HASHES,
    "Pin": _HASHES,
    "Reserve": _HASHES + RESERVE_META_BYTES,
    "Commit": _SLOTS + _HASHES + RESERVE_META_BYTES,  # it may name unnamed slots
    "Abort": _SLOTS,
    "Release": _SLOTS,
    "Put": MAX_MESSAGE_BYTES,
    "SlotOps": SLOT_BATCH_BYTES + _HASHES + RESERVE_META_BYTES,
}
"""Largest encoded request per method; methods not named here take small requests only."""


@dataclass(frozen=True, slots=True)
class Refused:
    """What a request that could not be taken decodes to."""

    code: grpc.StatusCode
    message: str
    kind: str


def guarded_decoder(name: str, message_type: type) -> Callable[[bytes], object]:
    limit = REQUEST_LIMITS.get(name, TUNABLES.small_request_bytes)

    def decode(raw: bytes) -> object:
        if len(raw) > limit:
            return Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{name} request of {len(raw)} B exceeds this method's {limit} B",
                f"{name}-too-large",
            )
        try:
            return message_type.FromString(raw)
        except (DecodeError, RuntimeError, ValueError) as exc:
            return Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"undecodable {name} request: {exc}",
                f"{name}-undecodable",
            )

    return decode


def add_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Registers every method of ``kvtier.v1.KvTier`` on ``server`` with guarded decoders."""
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        if method.client_streaming and method.server_streaming:
            make = grpc.stream_stream_rpc_method_handler
        elif method.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=guarded_decoder(method.name, request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
