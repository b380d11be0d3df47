"""When the disk tier's blocks were last used: sparse wall-clock samples of its access order.

The index keeps recency as sequence numbers (``order``), not times. The ``clock`` database maps
a big-endian sequence number to the wall-clock time (``time.time``, so it means the same after
a restart) at which that number was issued. A sample is written in the write transaction that
issues the number, and only when the newest sample is at least ``RESOLUTION_S`` old: at most
one a second of activity, however many blocks are stored or read.

Sequence numbers grow with time, so the newest sample at or before a block's sequence number
is a time at or before the block's last recorded use, and later than it by less than
``RESOLUTION_S`` (plus any sample thinned out, below): ``now`` minus that time is an upper
bound on the block's age. A read counts once its access bump is committed (the writer defers
bumps to its next commit), as it does for the LRU order itself.

Bounded: whenever a sample is written, samples older than the one that dates the oldest live
block are deleted; if a tier whose oldest block stays put still gathers more than
``MAX_SAMPLES`` (a long run of reads with no evictions), every other sample between that one
and the newest is dropped, which only coarsens the bound for the blocks they dated.

An index from before this database, or one whose oldest blocks predate its first sample, has
no time for those blocks: their age is None, never a guess, until they are read or evicted.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import lmdb

RESOLUTION_S = 1.0
MAX_SAMPLES = 1024
"""Most samples kept: about 30 KiB of the map, far below a tier's slack."""

_SEQ = struct.Struct(">Q")
_TIME = struct.Struct(">d")


class AccessClock:
    """The ``clock`` database of ``env``, dating the sequence numbers of ``order`` (that
    database's handle) with times read from ``clock``.

    Writes happen in the caller's write transactions (the tier's writer thread); ``age_s``
    reads in a read transaction from any thread.
    """

    def __init__(self, env: lmdb.Environment, order: Any, clock: Callable[[], float]) -> None:
        self._db = env.open_db(b"clock")
        self._order = order
        self._clock = clock
        self._newest: float | None = None
        """The newest sample's time, kept here so that stamping a block reads no database (a
        sample rolled back with its transaction leaves an older one dating later blocks: a
        looser bound, never a wrong one)."""

    def stamp(self, txn: lmdb.Transaction, seq: int) -> None:
        """Dates ``seq``, just issued in ``txn``, if the newest sample is ``RESOLUTION_S`` old
        (or from a clock set back); then prunes."""
        now = self._clock()
        if self._newest is not None and 0.0 <= now - self._newest < RESOLUTION_S:
            return
        txn.put(_SEQ.pack(seq), _TIME.pack(now), db=self._db)
        self._newest = now
        self._prune(txn)

    def load(self, txn: lmdb.Transaction, next_seq: int) -> None:
        """At open: deletes samples of numbers not issued yet (their blocks are gone and the
        numbers will be issued again) and those older than the oldest live block needs."""
        cursor = txn.cursor(db=self._db)
        stale = []
        if cursor.set_range(_SEQ.pack(next_seq)):
            stale = [bytes(key) for key in cursor.iternext(keys=True, values=False)]
        for key in stale:
            txn.delete(key, db=self._db)
        self._prune(txn)
        cursor = txn.cursor(db=self._db)
        self._newest = _time(cursor.value()) if cursor.last() else None

    def age_s(self, txn: lmdb.Transaction) -> float | None:
        """Seconds since the least recently used block was last used, an upper bound (see the
        module); 0.0 with no blocks; None if no sample dates that block."""
        oldest = txn.cursor(db=self._order)
        if not oldest.first():
            return 0.0
        cursor = txn.cursor(db=self._db)
        found = _at_or_before(cursor, bytes(oldest.key()))
        used = _time(cursor.value()) if found else None
        return None if used is None else max(0.0, self._clock() - used)

    def _prune(self, txn: lmdb.Transaction) -> None:
        oldest = txn.cursor(db=self._order)
        cursor = txn.cursor(db=self._db)
        if oldest.first() and _at_or_before(cursor, bytes(oldest.key())):
            older = []  # before the sample that dates the oldest block: they date no block
            while cursor.prev():
                older.append(bytes(cursor.key()))
            for key in older:
                txn.delete(key, db=self._db)
        if txn.stat(self._db)["entries"] > MAX_SAMPLES:
            self._thin(txn)

    def _thin(self, txn: lmdb.Transaction) -> None:
        """Deletes every other sample, never the first (which dates the oldest block, once
        pruned) nor the newest (which dates what is issued next)."""
        cursor = txn.cursor(db=self._db)
        keys = [bytes(key) for key in cursor.iternext(keys=True, values=False)]
        for key in keys[1:-1:2]:
            txn.delete(key, db=self._db)


def _at_or_before(cursor: lmdb.Cursor, key: bytes) -> bool:
    """Puts ``cursor`` on the last sample whose key is at most ``key``; False if there is none."""
    if cursor.set_range(key):
        return bytes(cursor.key()) == key or cursor.prev()
    return cursor.last()


def _time(value: bytes | memoryview) -> float | None:
    """A sample's time, None for a value of another size (damage: the sample is unusable)."""
    return _TIME.unpack(value)[0] if len(value) == _TIME.size else None
