"""The lookup index: what a layout's host and disk tiers hold, published in shared memory.

The daemon is its only writer; a client maps it read-only (``connector.client.index_reader``)
and answers a lookup with a compiled probe of it instead of a call. What a probe says is a
hint: an ``Acquire`` names hashes, and the daemon resolves them again where the bytes are
handed over, so a stale or torn read can cost a hit but never hand out a wrong block.

The file is a header and an open-addressing table (linear probing, at most half full) of
``ENTRY`` records: a 16-byte block hash and a byte of tier bits. A hash, once written into a
record, stays there until the table is rebuilt: removing a block clears its bits, so no
reader ever sees one record change from one hash to another. The writer publishes a record's
hash before its bits, and a reader trusts bits only under a matching hash. When the table
fills (live and cleared records together), the writer builds a new file, renames it over the
old name and marks the old one ``RETIRED``; a reader that sees the mark maps the new one.

A daemon that dies without retiring its index (killed) leaves the file as it was: the writer
holds a lock on the file it publishes, which the kernel lets go with the process (or when the
writer replaces the file and closes it), and a reader that finds no lock held knows nobody
keeps that file any more and answers no probe from it. The lock is an open file description's
record lock (``F_OFD_SETLK``), which a reader queries with one ``fcntl`` that neither takes
it nor raises (``is_kept``). The writer holds an exclusive ``flock`` too: the readers of
clients from before the record lock try to take that, and a reader finds a writer from before
it by it (``is_flock_kept``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from kvtier.proto.contract import HASH_BYTES

MAGIC = 0x4B56_5449_4458_0001  # "KVTIDX", format 1
HOST, DISK = 1, 2
"""Tier bits of a record."""
HEADER = struct.Struct("<QQQII")
"""magic, capacity (records), generation, retired flag, has_remote flag."""
HEADER_BYTES = 64
RECORD_BYTES = 32
"""A record: the hash (16 bytes), its tier bits (1 byte), padding to a power of two."""
_TIERS_AT = 16
TIERS_WORD = _TIERS_AT // 8
"""A record's 64-bit word whose low byte (little-endian) is its tier bits."""
MIN_CAPACITY = 1024
MAX_PROBES = 64
"""A probe that walks this far finds the table badly clustered: it answers a miss."""
RETIRED_AT = 24
_HASH_WORDS = struct.Struct("<QQ")
_FLOCK = struct.Struct("hhqqi4x")
"""Linux's ``struct flock``: type, whence, start, length (0: the whole file), pid (0 for a
record lock of an open file description)."""
_WHOLE_FILE_LOCK = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
_WHOLE_FILE_QUERY = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
_NO_LOCK = struct.pack("h", fcntl.F_UNLCK)


def keep(fd: int) -> None:
    """Takes the writer's locks on the file open at ``fd`` (read-write), for as long as it
    stays open."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WHOLE_FILE_LOCK)


def is_kept(fd: int) -> bool:
    """Whether a live writer keeps the file open at ``fd`` (it holds the lock ``keep`` took):
    one system call, which takes no lock."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _WHOLE_FILE_QUERY)
    return answer[:2] != _NO_LOCK


def is_flock_kept(fd: int) -> bool:
    """Whether a live writer holds its ``flock`` on the file open at ``fd``: all that a daemon
    from before the record lock holds (a shared lock it refuses is one a writer holds)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _capacity_for(blocks: int) -> int:
    """Records for ``blocks`` live hashes: a power of two at least four times as many, so the
    table stays under half full with as many cleared records as live ones."""
    return max(MIN_CAPACITY, 1 << max(0, 4 * blocks - 1).bit_length())


HASH_MIX = 0x9E37_79B9_7F4A_7C15
_WORD = (1 << 64) - 1


def _shift_for(capacity: int) -> int:
    """How far a mixed 64-bit hash shifts right to leave a record number of a table of
    ``capacity`` records (a power of two)."""
    return 64 - (capacity.bit_length() - 1)


def _buckets(words: np.ndarray, capacity: int) -> np.ndarray:
    """Each hash's home record, from its two 64-bit words (``[n, 2]``): both words mixed by a
    multiplicative hash, so that hashes alike in either word (a test's, a caller's own) still
    spread over the table instead of clustering into long probes."""
    shift = np.uint64(_shift_for(capacity))
    mix = np.uint64(HASH_MIX)
    with np.errstate(over="ignore"):
        mixed = (words[:, 0] ^ (words[:, 1] * mix)) * mix
    return (mixed >> shift).astype(np.int64) if capacity > 1 else np.zeros(len(words), np.int64)


def _bucket(key: bytes, capacity: int) -> int:
    """``_buckets`` of one hash, in plain integers: the writer places one hash at a time, and
    numpy's per-call cost (about 10 µs for a one-row array) would be most of a commit's."""
    if capacity <= 1:
        return 0
    low, high = _HASH_WORDS.unpack(key)
    mixed = ((low ^ (high * HASH_MIX & _WORD)) * HASH_MIX) & _WORD
    return mixed >> _shift_for(capacity)


def index_path(socket: str | os.PathLike[str], layout_signature: bytes) -> Path:
    """The index of one layout of the daemon listening on ``socket``: a file beside the socket,
    in the directory only the daemon's user may enter, so a client of that daemon on this host
    finds it and nobody else reads it. (Not beside the arena: it must not take the room a
    restarted daemon's new arena needs.)"""
    socket = os.path.abspath(os.fspath(socket))
    return Path(f"{socket}.{layout_signature.hex()}.index")


class Table:
    """Views of a mapped table: its records as four 64-bit words each (the hash's two
    first), and each record's tier bits."""

    def __init__(self, mapped: mmap.mmap, capacity: int):
        records = np.frombuffer(mapped, np.uint8, capacity * RECORD_BYTES, HEADER_BYTES)
        self.words = np.ndarray((capacity, RECORD_BYTES // 8), "<u8", mapped, HEADER_BYTES)
        self.tiers = records.reshape(capacity, RECORD_BYTES)[:, _TIERS_AT]
        self.capacity = capacity


def _place(homes: np.ndarray, capacity: int) -> np.ndarray:
    """Where linear probing from ``homes`` puts each of a batch of distinct hashes in an empty
    table, all at once: each round, the first hash aiming at each free record takes it and
    every other moves on by one. A hash ends up past a record only where that record was
    taken, as a reader's probe expects. (A rebuild of 100,000 hashes one insert at a time
    held the writer's lock for 0.45 s on the 2-core VM; this takes a few tens of ms.)"""
    records = homes.copy()
    placed = np.empty(len(homes), np.int64)
    taken = np.zeros(capacity, bool)
    pending = np.arange(len(homes))
    while len(pending):
        aims = records[pending]
        targets, first = np.unique(aims, return_index=True)
        free = ~taken[targets]
        targets, winners = targets[free], pending[first[free]]
        taken[targets] = True
        placed[winners] = targets
        moving = np.ones(len(pending), bool)
        moving[first[free]] = False
        pending = pending[moving]
        records[pending] = (records[pending] + 1) & (capacity - 1)
    return placed


class LookupIndexWriter:
    """The daemon's side: ``set`` and ``clear`` tier bits of hashes, thread-safe."""

    def __init__(self, path: str | os.PathLike[str], blocks: int, has_remote: bool = False):
        self.path = Path(path)
        self.has_remote = has_remote
        self._lock = threading.Lock()
        self._generation = 0
        self._slots: dict[bytes, int] = {}
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        """The published file, open and locked for as long as this writer keeps it."""
        for left in self.path.parent.glob(f"{self.path.name}.*"):
            left.unlink(missing_ok=True)  # a table a dead daemon was building
        self._build(_capacity_for(blocks), [], np.zeros(0, np.uint8))

    def _build(self, capacity: int, keys: list[bytes], bits: np.ndarray) -> None:
        """Writes a table holding ``keys`` (distinct) with their tier ``bits`` into a new file
        and publishes it."""
        self._generation += 1
        size = HEADER_BYTES + capacity * RECORD_BYTES
        fresh = self.path.with_name(f"{self.path.name}.{os.getpid()}.{self._generation}")
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            keep(fd)
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        mapped[:HEADER_BYTES] = HEADER.pack(
            MAGIC, capacity, self._generation, 0, int(self.has_remote)
        ).ljust(HEADER_BYTES, b"\0")
        old_map = self._map
        table = Table(mapped, capacity)
        words = np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2)
        records = _place(_buckets(words, capacity), capacity)
        table.words[records, :2] = words
        table.tiers[records] = bits
        self._map, self._table, self._used = mapped, table, len(keys)
        taken = np.zeros(capacity, np.uint8)
        taken[records] = 1
        self._taken = bytearray(taken.tobytes())
        self._slots = dict(zip(keys, records.tolist(), strict=True))
        os.replace(fresh, self.path)
        if old_map is not None:
            old_map[RETIRED_AT : RETIRED_AT + 4] = struct.pack("<I", 1)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd

    def _insert(self, key: bytes) -> int:
        """Writes ``key`` into the first never-used record from its home; returns the record.
        (``_taken`` mirrors which records hold a hash: reading it costs less than comparing
        the file's bytes, and the writer is the daemon's per-block work.)"""
        taken, mask = self._taken, self._table.capacity - 1
        record = _bucket(key, self._table.capacity)
        while taken[record]:
            record = (record + 1) & mask
        taken[record] = 1
        at = HEADER_BYTES + record * RECORD_BYTES
        self._map[at : at + HASH_BYTES] = key
        self._used += 1
        return record

    def set(self, block_hash: bytes, tier: int) -> None:
        """Marks ``block_hash`` as held by ``tier`` (``HOST`` or ``DISK``)."""
        self._change([block_hash], tier, True)

    def clear(self, block_hash: bytes, tier: int) -> None:
        """Marks ``block_hash`` as no longer held by ``tier``."""
        self._change([block_hash], tier, False)

    def set_all(self, hashes: list[bytes], tier: int) -> None:
        """``set`` of each hash, under one lock (a commit's or an eviction's batch)."""
        self._change(hashes, tier, True)

    def clear_all(self, hashes: list[bytes], tier: int) -> None:
        """``clear`` of each hash, under one lock."""
        self._change(hashes, tier, False)

    def _change(self, hashes: list[bytes], tier: int, held: bool) -> None:
        if any(len(block_hash) != HASH_BYTES for block_hash in hashes):
            bad = next(h for h in hashes if len(h) != HASH_BYTES)
            raise ValueError(f"a block hash has {HASH_BYTES} bytes, not {len(bad)}")
        with self._lock:
            if self._map is None:
                return
            for block_hash in hashes:
                record = self._slots.get(block_hash)
                if record is None:
                    if not held:
                        continue
                    if 2 * (self._used + 1) > self._table.capacity:
                        self._rebuild()
                    record = self._slots[block_hash] = self._insert(block_hash)
                at = HEADER_BYTES + record * RECORD_BYTES + _TIERS_AT
                bits = self._map[at]
                self._map[at] = bits | tier if held else bits & ~tier

    def _rebuild(self) -> None:
        """A fresh table of the hashes some tier still holds (cleared records left out)."""
        keys = list(self._slots)
        bits = self._table.tiers[np.fromiter(self._slots.values(), np.int64, len(keys))]
        held = np.flatnonzero(bits)
        self._build(_capacity_for(len(held) + 1), [keys[i] for i in held.tolist()], bits[held])

    def close(self) -> None:
        """Unlinks the index; clients holding it see it retired and probe no more."""
        with self._lock:
            if self._map is None:
                return
            self._map[RETIRED_AT : RETIRED_AT + 4] = struct.pack("<I", 1)
            self._table = None
            self._map = None
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
