"""A client's read-only view of the daemon's lookup index (``proto.lookup_index``), and the
probe that answers a lookup from it.

The probe is one compiled loop (numba, which vLLM already brings into an engine's
environment): each hash's home record, then linear probing to the hash or an empty record.
It also counts the hits a lookup needs (the prefix some tier holds, the host's share), which
took the caller a few more array calls. The same walk in numpy took a dozen array calls per
round: on the 2-core VM a 1,000-hash probe, with the liveness check and packing the hashes,
took 107 to 195 µs back to back and 445 to 459 µs after the 20 ms idle pause a paced client
takes between requests; now 30 to 36 and 231 to 237 µs (the walk itself about 5 and 80).

A probe reads records the daemon may be writing: a record's hash is published before its
tier bits and never changes until the table is rebuilt, so a torn read can at worst miss a
hash, and a hit is a hint the daemon resolves again at ``Acquire``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numba
import numpy as np
from numba import types

from kvtier.proto.contract import HASH_BYTES
from kvtier.proto.lookup_index import (
    HASH_MIX,
    HEADER,
    HEADER_BYTES,
    HOST,
    MAGIC,
    MAX_PROBES,
    MIN_CAPACITY,
    RECORD_BYTES,
    RETIRED_AT,
    Table,
)

_WORDS = types.Array(types.uint64, 2, "C", readonly=True)
_PROBE_SIGNATURE = types.UniTuple(types.int64, 2)(
    _WORDS,
    types.Array(types.uint8, 1, "A", readonly=True),
    _WORDS,
    types.uint64,
    types.uint8[::1],
    types.boolean,
)


def _compiled(function):
    """``function`` compiled now, at import, not at the first probe: an engine's first lookup
    would otherwise wait about a second for it. The machine code is cached beside the module
    or in the user's cache (``NUMBA_CACHE_DIR`` chooses), and compiled afresh in each process
    where neither can be written (numba refuses to cache then, and an engine must start)."""
    try:
        return numba.njit(_PROBE_SIGNATURE, cache=True)(function)
    except RuntimeError:  # no writable cache location
        return numba.njit(_PROBE_SIGNATURE)(function)


@_compiled
def _probe_table(words, tiers, want, shift, bits, prefix):
    """Writes each wanted hash's tier bits into ``bits`` (left 0 on a miss) and returns how
    many hashes it walked and how many of those the host tier holds; with ``prefix`` it stops
    at the first miss, as a lookup does. ``words`` are the table's records as 64-bit words
    (the hash's two first), ``want`` the hashes as two words each, ``shift`` what makes a
    mixed hash a record number. No read leaves the map: a home record is below the capacity
    (by the shift), so is each next one (by the mask), and the reader checked that the file
    holds that many records."""
    mask = words.shape[0] - 1
    mix = np.uint64(HASH_MIX)
    host = 0
    for i in range(want.shape[0]):
        low, high = want[i, 0], want[i, 1]
        record = np.int64(((low ^ (high * mix)) * mix) >> shift)
        for _ in range(MAX_PROBES):
            first, second = words[record, 0], words[record, 1]
            if first == low and second == high:
                bits[i] = tiers[record]
                break
            if first == 0 and second == 0:
                break
            record = (record + 1) & mask
        if bits[i] & HOST:
            host += 1
        elif prefix and not bits[i]:
            return i, host
    return want.shape[0], host


class PrefixHits(NamedTuple):
    """A lookup's answer from the index: the first ``held`` hashes are in a tier, ``host`` of
    them in the host tier; ``bits`` are their tier bits."""

    held: int
    host: int
    bits: np.ndarray


class LookupIndexReader:
    """``probe`` returns None when there is no usable index (none published, retired and not
    yet replaced, or its writer dead): the caller then asks the daemon."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._table: Table | None = None
        self._shift = np.uint64(0)
        self.has_remote = False

    def _mapped(self) -> bool:
        if self._map is not None and not self._retired() and self._kept():
            return True
        self.close()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        self._fd = fd
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES or not self._kept():
            self.close()
            return False
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        magic, capacity, _, retired, has_remote = HEADER.unpack_from(mapped)
        if (
            magic != MAGIC
            or retired
            or capacity < MIN_CAPACITY
            or capacity & (capacity - 1)  # the writer's are powers of two: a foreign file
            or size < HEADER_BYTES + capacity * RECORD_BYTES
        ):
            mapped.close()
            self.close()
            return False
        self._map, self.has_remote = mapped, bool(has_remote)
        self._table = Table(mapped, capacity)
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))
        return True

    def _retired(self) -> bool:
        return struct.unpack_from("<I", self._map, RETIRED_AT)[0] != 0

    def _kept(self) -> bool:
        """Whether a live writer still holds the file (its lock is one we cannot take)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def probe(self, hashes: Sequence[bytes] | Iterable[bytes]) -> np.ndarray | None:
        """Each hash's tier bits (0: neither tier holds it), or None without an index."""
        found = self._walk(hashes, prefix=False)
        return None if found is None else found.bits

    def probe_prefix(self, hashes: Sequence[bytes] | Iterable[bytes]) -> PrefixHits | None:
        """How many of ``hashes``, from the first, some tier holds (the walk stops at the
        first miss), or None without an index."""
        return self._walk(hashes, prefix=True)

    def _walk(self, hashes: Sequence[bytes] | Iterable[bytes], prefix: bool) -> PrefixHits | None:
        if not self._mapped():
            return None
        packed = b"".join(hashes)
        if len(packed) % HASH_BYTES:
            raise ValueError(f"block hashes have {HASH_BYTES} bytes each")
        want = np.frombuffer(packed, "<u8").reshape(-1, 2)
        bits = np.zeros(len(want), np.uint8)
        held, host = _probe_table(
            self._table.words, self._table.tiers, want, self._shift, bits, prefix
        )
        return PrefixHits(held, host, bits)

    def close(self) -> None:
        self._table = None
        self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
