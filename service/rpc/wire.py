"""Validation of what clients send, before any of it reaches the tiers.

Each check raises ``RequestError`` with the gRPC status code the servicer answers with, so
nothing a client sends can reach a tier in a shape the tier does not expect.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence

import grpc

from kvtier.proto.contract import HASH_BYTES


class RequestError(Exception):
    """A call the daemon refuses, with the status code to answer it with.

    ``kind`` names requests that are malformed rather than merely refused (undecodable, too
    large): those are logged, rate-limited, since they point at a broken or hostile client.
    """

    def __init__(self, code: grpc.StatusCode, message: str, kind: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def split_hashes(packed: bytes, max_count: int, what: str = "hashes") -> list[bytes]:
    """Unpacks ``16 * n`` bytes into ``n`` hashes, bounding ``n``."""
    if len(packed) % HASH_BYTES:
        raise invalid(f"{what}: {len(packed)} bytes is not a multiple of {HASH_BYTES}")
    count = len(packed) // HASH_BYTES
    if count > max_count:
        raise RequestError(
            grpc.StatusCode.OUT_OF_RANGE, f"{what}: {count} in one call, at most {max_count}"
        )
    return list(_unpacker(count).unpack(packed))


@functools.lru_cache(maxsize=128)
def _unpacker(count: int) -> struct.Struct:
    # One C-level unpack of n 16-byte strings costs a fraction of n Python slices.
    return struct.Struct(f"{HASH_BYTES}s" * count)


def check_slots(slots: Sequence[int], num_slots: int, max_count: int) -> list[int]:
    """Bounds the count and the range of slot ids."""
    if len(slots) > max_count:
        raise RequestError(
            grpc.StatusCode.OUT_OF_RANGE, f"{len(slots)} slots in one call, at most {max_count}"
        )
    bad = [s for s in slots if s >= num_slots]
    if bad:
        raise invalid(f"slot ids out of range 0..{num_slots - 1}: {bad[:8]}")
    return list(slots)


def check_hash(block_hash: bytes, what: str = "hash") -> bytes:
    if len(block_hash) != HASH_BYTES:
        raise invalid(f"{what} is {len(block_hash)} bytes, must be {HASH_BYTES}")
    return block_hash
