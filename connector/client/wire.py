"""How the client cuts requests for the daemon: hashes packed into one field, and a Reserve's
hashes split so that no call carries more than the daemon accepts."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.hashing import BlockHash

RESERVE_META_BYTES = 16 << 20
"""Most engine metadata bytes sent in one Reserve (the daemon allows twice that)."""


def meta_chunks(
    hashes: Sequence[BlockHash], metas: Sequence[bytes] | None, max_hashes: int
) -> list[tuple[int, int]]:
    """[start, end) ranges of at most ``max_hashes`` hashes and ``RESERVE_META_BYTES`` metas."""
    ranges, start, size = [], 0, 0
    for i in range(len(hashes)):
        meta = len(metas[i]) if metas else 0
        if i > start and (i - start >= max_hashes or size + meta > RESERVE_META_BYTES):
            ranges.append((start, i))
            start, size = i, 0
        size += meta
    if start < len(hashes):
        ranges.append((start, len(hashes)))
    return ranges


def pack_hashes(hashes: Sequence[BlockHash]) -> bytes:
    """The hashes as one bytes field, as every request that names blocks carries them."""
    packed = b"".join(hashes)
    if len(packed) != 16 * len(hashes):
        raise ValueError("every block hash must be 16 bytes")
    return packed
