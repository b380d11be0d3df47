"""A client's read-only view of the daemon's lookup index (``proto.lookup_index``), and the
probe that answers a lookup from it.

The probe is one compiled loop (``probe_kernel``; numba, which vLLM already brings into an
engine's environment), loaded on a thread when a client starts (``start_loading_probe``):
each hash's home record, then linear probing to the hash or an empty record.
It also counts the hits a lookup needs (the prefix some tier holds, the host's share), which
took the caller a few more array calls. The same walk in numpy took a dozen array calls per
round: on the 2-core VM a 1,000-hash probe, with the liveness check and packing the hashes,
took 107 to 195 µs back to back and 445 to 459 µs after the 20 ms idle pause a paced client
takes between requests; compiled, 30 to 36 and 231 to 237 µs (the walk itself about 5 and 80).
After that pause everything here runs several times slower than back to back, so the probe
makes as few calls as it can: the writer's liveness is one ``fcntl`` that neither raises nor
takes a lock (``is_kept``; it was a lock taken, refused with an exception, 47 µs after the
pause), the hashes' view is the compiled loop's own, which makes no array for its answer
and is called without numba's dispatcher (``probe_kernel.entry_point``). Even that
``fcntl`` was 26 to 29 µs of a 240 µs lookup after the pause, so a reader trusts a writer it
found alive for ``WRITER_RECHECK_S`` before it asks again.

A probe reads records the daemon may be writing: a record's hash is published before its
tier bits and never changes until the table is rebuilt, so a torn read can at worst miss a
hash, and a hit is a hint the daemon resolves again at ``Acquire``.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvtier.proto.contract import HASH_BYTES
from kvtier.proto.lookup_index import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MIN_CAPACITY,
    RECORD_BYTES,
    RETIRED_AT,
    Table,
    is_flock_kept,
    is_kept,
)

log = logging.getLogger(__name__)

WRITER_RECHECK_S = 1.0
"""How long a reader trusts its last finding that the index's writer lives. The check is a
backstop: a daemon that dies ends its sessions' streams, and a client without a session
probes nothing. Between a death and its client noticing, a probe may give hints that the
``Acquire`` then fails (counted misses, never a wrong block), as a death just after any probe
does. A paced engine that looks up every 0.2 s would pay the check on every lookup at 0.1 s.
A retired index is seen at once (a flag in the mapped header)."""
_clock = time.monotonic

_walk_table: Callable[..., tuple[int, int]] | None = None
"""The compiled probe (``probe_kernel.walk_table``'s machine code), once its loader thread
has loaded it."""
_NO_BITS = np.zeros(0, np.uint8)
"""The tier bits' array of a probe that wants only the counts (the probe writes none)."""
_loader: threading.Thread | None = None
_loader_lock = threading.Lock()


def start_loading_probe() -> threading.Thread:
    """The thread that loads the compiled probe, started by the first call in a process.
    Loading takes about a second, most of it numba's own start (less with its on-disk
    cache), so a client starts it and answers lookups by call until it is done. Never at
    import: vLLM's CPU build (0.32) scans every loaded module when its worker starts, and
    fails on one of llvmlite's, so numba must not be loaded in an engine's process before
    its engine has started."""
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = threading.Thread(target=_load, name="kvtier-probe-load")
            _loader.start()
        return _loader


def load_probe() -> bool:
    """Waits for the compiled probe (starting its load if need be); True if it loaded."""
    start_loading_probe().join()
    return _walk_table is not None


def _load() -> None:
    global _walk_table
    try:
        from kvtier.connector.client.probe_kernel import entry_point, walk_table

        loaded = entry_point(walk_table)
    except Exception:  # no numba, or one that cannot compile it: calls still answer
        log.warning("lookups go to the daemon: no compiled probe", exc_info=True)
        return
    _walk_table = loaded


class PrefixHits(NamedTuple):
    """A lookup's answer from the index: the first ``held`` hashes are in a tier, ``host`` of
    them in the host tier."""

    held: int
    host: int


class LookupIndexReader:
    """``probe`` returns None when there is no usable index (none published, retired and not
    yet replaced, or its writer dead) or no compiled probe loaded yet: the caller then asks
    the daemon."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._words: np.ndarray | None = None
        self._kept: Callable[[int], bool] = is_kept
        """How this file's writer shows it keeps the file: ``is_flock_kept`` for a daemon
        from before the record lock."""
        self._kept_at = -math.inf
        """When ``_kept`` last found the writer alive (``_clock``)."""
        self.has_remote = False

    def _mapped(self) -> bool:
        # The retired flag's low byte is enough: the writer sets the flag to 1.
        if self._map is not None and not self._map[RETIRED_AT] and self._writer_lives():
            return True
        self.close()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        self._fd = fd
        size = os.fstat(fd).st_size
        self._kept = is_kept if is_kept(fd) else is_flock_kept
        if size < HEADER_BYTES or not self._kept(fd):
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
        self._words = Table(mapped, capacity).words
        self._kept_at = _clock()
        return True

    def _writer_lives(self) -> bool:
        """Whether the mapped file's writer lives, asked at most every ``WRITER_RECHECK_S``."""
        now = _clock()
        if now - self._kept_at < WRITER_RECHECK_S:
            return True
        if not self._kept(self._fd):
            return False
        self._kept_at = now
        return True

    def probe(self, hashes: Sequence[bytes] | Iterable[bytes]) -> np.ndarray | None:
        """Each hash's tier bits (0: neither tier holds it), or None without an index."""
        packed = b"".join(hashes)
        bits = np.zeros(len(packed) // HASH_BYTES, np.uint8)
        return None if self._walk(packed, False, bits) is None else bits

    def probe_prefix(self, packed: bytes, bits: np.ndarray | None = None) -> PrefixHits | None:
        """How many of the hashes ``packed`` end to end, from the first, some tier holds (the
        walk stops at the first miss), or None without an index. A ``bits`` array of a byte
        per hash gets the tier bits of each walked one."""
        return self._walk(packed, True, _NO_BITS if bits is None else bits)

    def _walk(self, packed: bytes, prefix: bool, bits: np.ndarray) -> PrefixHits | None:
        if _walk_table is None or not self._mapped():
            return None
        if len(packed) % HASH_BYTES:
            raise ValueError(f"block hashes have {HASH_BYTES} bytes each")
        return PrefixHits(*_walk_table(self._words, packed, prefix, bits))

    def close(self) -> None:
        self._words = None
        self._map = None
        self._kept_at = -math.inf
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
