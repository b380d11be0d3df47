"""The disk tier's index: small LMDB entries that say where each block is, and its recency.

Three named databases change together in the same transactions: ``index`` maps a 16-byte
block hash to an ``Entry`` (format version, access sequence number, slot, layout signature,
payload length, xxh3_64 of the payload) followed by the block's meta (opaque bytes, at most
``MAX_META_BYTES``); ``order`` maps the big-endian sequence number back to the hash, so its first
key is the least recently used block; ``clock`` dates some sequence numbers (``clock``), so the
oldest block's age is known. The block bytes themselves live in the data file (``slots``).

Format 2 entries (no meta) are still read, as blocks with empty meta; an entry is written in
the current format whenever it is rewritten (a read bumping its recency, a move at open).

``BlockIndex`` follows py-lmdb's rules: one writer thread (the tier's) makes every write
transaction, readers use short read transactions.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

import lmdb

from kvtier.tiers.disk.clock import AccessClock
from kvtier.tiers.lower import MAX_META_BYTES

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
INDEX_DB = b"index"
"""The database of block entries, hash -> entry (its entry count is the block count)."""
_READABLE_VERSIONS = (2, 3)  # 2: the same header with no meta after it
# big-endian, the checksum last: its bytes are those of ``xxh3_64_digest``
_ENTRY = struct.Struct(">HQQ16sQQ")
# order key: big-endian, so LMDB's byte order is access order
_SEQ = struct.Struct(">Q")
# A key of the main database, written only to make a commit (see ``writer``).
_MARKER = b"kvtier-marker"


class Entry(NamedTuple):
    """Where a block is, how to check it, and the caller's meta."""

    version: int
    seq: int
    slot: int
    signature: bytes
    length: int
    checksum: int
    meta: bytes = b""

    def pack(self) -> bytes:
        """The value stored for this entry, always in the current format."""
        return _ENTRY.pack(FORMAT_VERSION, *self[1:6]) + self.meta


UNREADABLE = Entry(0, 0, -1, b"", 0, 0)
"""What ``BlockIndex.get`` returns for a value of another format: an entry naming no slot."""


def parse(value: bytes | memoryview) -> Entry | None:
    """The entry stored as ``value`` (meta copied out), or None for a value of another format."""
    if len(value) < _ENTRY.size or len(value) > _ENTRY.size + MAX_META_BYTES:
        return None
    version, *fields = _ENTRY.unpack_from(value)
    if version not in _READABLE_VERSIONS or (version == 2 and len(value) != _ENTRY.size):
        return None
    return Entry(version, *fields, bytes(value[_ENTRY.size :]))


class BlockIndex:
    """The ``index`` and ``order`` databases of the LMDB environment at ``path``.

    Files are created with mode 0600. ``map_size`` is address space only: the file grows as
    used. ``clock`` gives the wall-clock times that date the access order.
    """

    def __init__(
        self, path: str, *, map_size: int, sync: bool, clock: Callable[[], float] = time.time
    ) -> None:
        self.env = lmdb.open(
            path,
            map_size=map_size,
            max_dbs=4,
            max_readers=512,
            sync=sync,
            metasync=sync,
            mode=0o600,
        )
        try:
            self.env.reader_check()
            self._index = self.env.open_db(INDEX_DB)
            self._order = self.env.open_db(b"order")
            self._clock = AccessClock(self.env, self._order, clock)
        except BaseException:
            self.env.close()
            raise
        self._next_seq = 0

    def read(self) -> lmdb.Transaction:
        """A short read transaction (use it in ``with``)."""
        return self.env.begin(db=self._index, buffers=True)

    def write(self) -> lmdb.Transaction:
        """A write transaction, for the writer thread only (use it in ``with``)."""
        return self.env.begin(write=True)

    def get(self, txn: lmdb.Transaction, block_hash: bytes) -> Entry | None:
        """The block's entry, ``UNREADABLE`` if its value cannot be parsed, None if absent."""
        value = txn.get(block_hash, db=self._index)
        return None if value is None else parse(value) or UNREADABLE

    def has(self, txn: lmdb.Transaction, block_hash: bytes) -> bool:
        return txn.get(block_hash, db=self._index) is not None

    def scan(self, after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` (hash, meta) pairs in key order after ``after``, in one short read."""
        found: list[tuple[bytes, bytes]] = []
        with self.read() as txn:
            cursor = txn.cursor(db=self._index)
            more = cursor.first() if after is None else cursor.set_range(after)
            while more and len(found) < limit:
                block_hash = bytes(cursor.key())
                entry = parse(cursor.value()) if block_hash != after else None
                if entry is not None:
                    found.append((block_hash, entry.meta))
                more = cursor.next()
        return found

    def touch(self, txn: lmdb.Transaction, block_hash: bytes, entry: Entry) -> None:
        """Makes the block's stored ``entry`` the most recently used."""
        txn.delete(_SEQ.pack(entry.seq), db=self._order)
        self.insert(txn, block_hash, entry)

    def insert(self, txn: lmdb.Transaction, block_hash: bytes, entry: Entry) -> None:
        """Stores the entry as the most recently used (its ``seq`` is assigned here)."""
        seq = self._next_seq
        self._next_seq += 1  # a gap left by an aborted transaction is harmless
        txn.put(block_hash, entry._replace(seq=seq).pack(), db=self._index)
        txn.put(_SEQ.pack(seq), block_hash, db=self._order)
        self._clock.stamp(txn, seq)

    def oldest_age_s(self) -> float | None:
        """Seconds since the least recently used block was last used, an upper bound with about
        a second's resolution (``clock``); 0.0 with no blocks; None if no sample dates it."""
        with self.read() as txn:
            return self._clock.age_s(txn)

    def replace(self, txn: lmdb.Transaction, block_hash: bytes, entry: Entry) -> None:
        """Rewrites an entry in place (same sequence number)."""
        txn.put(block_hash, entry.pack(), db=self._index)

    def delete(self, txn: lmdb.Transaction, block_hash: bytes, entry: Entry) -> None:
        txn.delete(block_hash, db=self._index)
        if entry is not UNREADABLE:  # its order key, if any, is left to ``evict`` and ``load``
            txn.delete(_SEQ.pack(entry.seq), db=self._order)

    def evict(self, txn: lmdb.Transaction, count: int) -> list[tuple[bytes, Entry]]:
        """Deletes up to ``count`` least recently used blocks; returns their hashes and entries.

        An order key whose entry is gone or newer is stale: it is deleted and not counted.
        """
        victims: list[tuple[bytes, bytes, Entry]] = []
        stale = []
        if count > 0:
            for key, block_hash in txn.cursor(db=self._order):
                value = txn.get(block_hash, db=self._index)
                entry = None if value is None else parse(value)
                if entry is None or entry.seq != _SEQ.unpack(key)[0]:
                    stale.append(key)
                    continue
                victims.append((key, bytes(block_hash), entry))
                if len(victims) == count:
                    break
        for key in stale:
            txn.delete(key, db=self._order)
        for key, block_hash, _ in victims:
            txn.delete(block_hash, db=self._index)
            txn.delete(key, db=self._order)
        return [(block_hash, entry) for _, block_hash, entry in victims]

    def mark(self, txn: lmdb.Transaction) -> None:
        """Writes a marker key, only so that a commit happens."""
        txn.put(_MARKER, b"")

    def load(
        self, txn: lmdb.Transaction, keep: Callable[[Entry], bool]
    ) -> tuple[dict[bytes, Entry], int]:
        """At open: returns ({hash: entry} kept, how many dropped).

        Drops entries of another format, entries ``keep`` refuses and all but one entry per
        slot; makes ``order`` follow the index and ``clock`` date only what it still holds;
        drops format 1's payload database.
        """
        if txn.get(b"blocks") is not None:  # format 1 kept the payloads in LMDB itself
            txn.drop(self.env.open_db(b"blocks", txn=txn), delete=True)
        entries: dict[bytes, Entry] = {}
        slots: set[int] = set()
        dropped = []
        for block_hash, value in txn.cursor(db=self._index):
            entry = parse(value)
            if entry is None or not keep(entry) or entry.slot in slots:
                dropped.append(block_hash)
            else:
                entries[block_hash] = entry
                slots.add(entry.slot)
        for block_hash in dropped:
            txn.delete(block_hash, db=self._index)
        ordered = set()
        for key, block_hash in txn.cursor(db=self._order):
            entry = entries.get(block_hash)
            if entry is None or entry.seq != _SEQ.unpack(key)[0]:
                txn.delete(key, db=self._order)
            else:
                ordered.add(block_hash)
        for block_hash, entry in entries.items():
            if block_hash not in ordered:
                txn.put(_SEQ.pack(entry.seq), block_hash, db=self._order)
        cursor = txn.cursor(db=self._order)
        self._next_seq = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
        self._clock.load(txn, self._next_seq)
        return entries, len(dropped)

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.close()
