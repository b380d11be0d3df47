"""How a block is stored in a remote key-value store: its key and its self-checking value.

A key is ``<prefix><block hash as 32 hex digits>``, ASCII. The prefix is the namespace: the
value format, the hash version and the layout signature, so that engines whose blocks are not
interchangeable never share a key, and no brace appears in it (a Redis cluster hashes the whole
key, spreading blocks over every slot).

A value is one byte string: a fixed header, the block's meta (the engine's identity of the
block, at most ``MAX_META_BYTES``, opaque here) and the payload, written as two parts (``head``
and the payload where the caller keeps it). The header names the format,
the layout signature, the block hash, both lengths and the xxh3_64 of meta and payload. A value
is only data if every one of those matches what the reader asked for: a wrong, torn, truncated
or foreign value is a miss, never a block.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

from kvtier.tiers.hashing import HASH_VERSION, check_hash
from kvtier.tiers.lower import MAX_META_BYTES

FORMAT_VERSION = 1
_MAGIC = b"kvtR"
_SIGNATURE_BYTES = 16
# magic, format version, flags (none yet), layout signature, block hash, payload length,
# meta length, xxh3_64 of meta then payload; big-endian like the disk tier's index.
_HEADER = struct.Struct(">4sHH16s16sQIQ")
HEADER_BYTES = _HEADER.size


def key_prefix(layout_signature: bytes, hash_version: int = HASH_VERSION) -> str:
    """The namespace of a layout's blocks: ``kvtier:f<format>:h<hash version>:<signature>:``."""
    if len(layout_signature) != _SIGNATURE_BYTES:
        raise ValueError(f"layout signature must be {_SIGNATURE_BYTES} bytes")
    return f"kvtier:f{FORMAT_VERSION}:h{hash_version}:{layout_signature.hex()}:"


def check_prefix(prefix: str) -> bytes:
    """The prefix as key bytes; refuses one a cluster would hash as a tag or that is not ASCII."""
    if not prefix or not prefix.isascii() or "{" in prefix or "}" in prefix:
        raise ValueError(f"key prefix must be non-empty ASCII without braces, got {prefix!r}")
    return prefix.encode("ascii")


def value_size(block_bytes: int, meta_bytes: int) -> int:
    return HEADER_BYTES + meta_bytes + block_bytes


def head(signature: bytes, block_hash: bytes, meta: bytes, payload: memoryview) -> bytes:
    """The bytes that go before ``payload`` in its stored value: the header, then ``meta``.

    The value is sent as these two parts, so the payload is never copied here; the checksum is
    taken from the payload as it is now. A caller that changed it before the send would store
    a value whose checksum fails: a miss for every reader, never wrong data.
    """
    checksum = xxhash.xxh3_64()
    checksum.update(meta)
    checksum.update(payload)
    header = _HEADER.pack(
        _MAGIC,
        FORMAT_VERSION,
        0,
        signature,
        block_hash,
        payload.nbytes,
        len(meta),
        checksum.intdigest(),
    )
    return header + meta


def unpack(value: Any, signature: bytes, block_hash: bytes, block_bytes: int) -> tuple[bytes, int]:
    """Checks a stored value; returns ``(meta, payload offset)``.

    Raises ``ValueError`` saying what is wrong when the value is not this block of this layout
    in this format with a matching checksum.
    """
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise ValueError(f"{view.nbytes} B is shorter than a header")
    magic, version, flags, sig, stored_hash, length, meta_len, checksum = _HEADER.unpack_from(view)
    if magic != _MAGIC or version != FORMAT_VERSION or flags:
        raise ValueError(
            f"format {magic!r} v{version} flags {flags:#x}, not {_MAGIC!r} v{FORMAT_VERSION}"
        )
    if sig != signature:
        raise ValueError(f"layout {sig.hex()}, not {signature.hex()}")
    if stored_hash != block_hash:
        raise ValueError(f"value of block {stored_hash.hex()}")
    if length != block_bytes or meta_len > MAX_META_BYTES:
        raise ValueError(f"payload {length} B with {meta_len} B of meta")
    if view.nbytes != value_size(length, meta_len):
        raise ValueError(f"{view.nbytes} B, the header says {value_size(length, meta_len)} B")
    if xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) != checksum:
        raise ValueError("checksum mismatch")
    return bytes(view[HEADER_BYTES : HEADER_BYTES + meta_len]), HEADER_BYTES + meta_len


def block_key(prefix: bytes, block_hash: bytes) -> bytes:
    """The key of one block under a checked prefix (``check_prefix``)."""
    check_hash(block_hash)
    return prefix + block_hash.hex().encode("ascii")
