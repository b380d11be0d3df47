"""The remote value format: a value is data only if every header field and the checksum match."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.tiers.remote.format import (
    HEADER_BYTES,
    block_key,
    check_prefix,
    head,
    key_prefix,
    unpack,
    value_size,
)

SIG = bytes(range(16))
HASH = bytes(range(100, 116))
BLOCK = 4096


def packed(meta: bytes = b"engine key", payload: bytes | None = None) -> bytes:
    payload = payload if payload is not None else np.arange(BLOCK, dtype=np.uint8).tobytes()
    return head(SIG, HASH, meta, memoryview(payload)) + payload


def test_round_trip_gives_meta_and_payload():
    payload = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    value = packed(b"meta!", payload)
    assert len(value) == value_size(BLOCK, 5)
    meta, offset = unpack(value, SIG, HASH, BLOCK)
    assert meta == b"meta!"
    assert value[offset:] == payload


@pytest.mark.parametrize("region", [0, 5, 6, 8, 24, 40, 48, 52, HEADER_BYTES, HEADER_BYTES + 3, -1])
def test_any_flipped_byte_is_refused(region):
    value = bytearray(packed())
    value[region] ^= 0x01
    with pytest.raises(ValueError):
        unpack(bytes(value), SIG, HASH, BLOCK)


@pytest.mark.parametrize("cut", [0, 10, HEADER_BYTES, HEADER_BYTES + 5, -1])
def test_torn_value_is_refused(cut):
    value = packed()
    with pytest.raises(ValueError):
        unpack(value[:cut], SIG, HASH, BLOCK)


def test_value_of_another_block_layout_or_size_is_refused():
    value = packed()
    with pytest.raises(ValueError, match="block"):
        unpack(value, SIG, bytes(16), BLOCK)
    with pytest.raises(ValueError, match="layout"):
        unpack(value, bytes(16), HASH, BLOCK)
    with pytest.raises(ValueError, match="payload"):
        unpack(value, SIG, HASH, BLOCK * 2)


def test_keys_are_namespaced_ascii_without_hash_tags():
    prefix = key_prefix(SIG, hash_version=1)
    assert prefix == f"kvtier:f1:h1:{SIG.hex()}:"
    assert key_prefix(SIG, 2) != prefix
    key = block_key(check_prefix(prefix), HASH)
    assert key == (prefix + HASH.hex()).encode()
    for bad in ("", "a{b", "ü:", "x}"):
        with pytest.raises(ValueError):
            check_prefix(bad)
    with pytest.raises(ValueError):
        block_key(b"p:", b"short")
