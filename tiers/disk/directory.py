"""The disk tier's directory: one owner at a time, private modes, and damage found before LMDB
maps it.

``TierDirectory`` takes an exclusive ``flock`` on ``kvtier.lock`` (holding the owner's pid) for
the tier's lifetime, so a second opener, in this process or another, is refused with the pid
that holds it. The directory is made 0700 and its files 0600.

A damaged index must never crash the process: LMDB maps ``data.mdb``, so a file shorter than
the pages its meta page says are in use ends in SIGBUS at the first read of a missing page.
So, before LMDB opens the file, ``lmdb_damage`` parses both meta pages (``struct``) and checks
them against the file size: LMDB itself refuses every page number at or past the current meta
page's ``last_pg + 1``, so a file that holds all those pages can be read without a fault,
whatever it was truncated to. Garbage inside B-tree pages (a leaf entry claiming a huge
overflow value, say) can still send LMDB past the file's end, which no cheap check rules out;
so unless the file is exactly as the last clean close left it, opening also walks every
database in a child process (``verify_in_child``, whose cost grows with the number of blocks),
and a child killed by a signal means damage. Damage found either way, or an LMDB error that
means a damaged file while opening and recovering, moves the index aside (``move_aside``) and
the tier starts empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import subprocess
import sys
import time

import lmdb

from kvtier.tiers.disk.slots import DATA_FILE
from kvtier.tiers.tunables import TUNABLES

log = logging.getLogger(__name__)

LOCK_FILE = "kvtier.lock"
CLEAN_FILE = "kvtier.clean"
LMDB_FILE = "data.mdb"
DAMAGED_TAG = ".damaged-"

# LMDB 0.9 (data format 1) on a 64-bit host: a page header (pgno, pad, flags, lower, upper)
# and, after it, the meta: magic, version, address, map size, the free and main databases
# (pad = page size for the first, flags, depth, branch, leaf and overflow pages, entries,
# root), the last used page and the id of the transaction that wrote it.
_PAGE_HEADER = struct.Struct("=QHHHH")
_META = struct.Struct("=IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_META_BYTES = _PAGE_HEADER.size + _META.size
_P_META = 0x08
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_NUM_METAS = 2
_NO_PAGE = (1 << 64) - 1
_ROOTS = (11, 19)  # the free and the main database's root page in ``_META``

# LMDB errors that say the environment, not the file, is wrong: moving the index aside would
# lose it for nothing, so these are raised with the directory named.
_NOT_DAMAGE = (
    lmdb.ReadonlyError,
    lmdb.DiskError,
    lmdb.MemoryError,
    lmdb.LockError,
    lmdb.MapFullError,
    lmdb.ReadersFullError,
    lmdb.DbsFullError,
    lmdb.TlsFullError,
    lmdb.InvalidParameterError,
)
DAMAGE_ERRORS = (lmdb.Error, struct.error)
"""What opening or recovering a damaged index raises (less ``is_damage``'s exceptions)."""

# The child's walk: every key and value of every database, copied out so that each byte is
# read; an lmdb error exits 3 with the message, a fault kills the child.
_WALK = """
import sys, lmdb
try:
    env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=64, subdir=True)
    with env.begin() as txn:
        names = [key for key, _ in txn.cursor()]
        for name in names:
            try:
                db = env.open_db(name, txn=txn, create=False)
            except lmdb.IncompatibleError:
                continue  # a plain key of the main database, not a database
            for _ in txn.cursor(db=db):
                pass
except lmdb.Error as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


class DirectoryInUse(RuntimeError):
    """Another opener holds the disk tier's directory."""


def is_damage(exc: BaseException) -> bool:
    """Whether an error met while opening or recovering the index means a damaged file."""
    return isinstance(exc, DAMAGE_ERRORS) and not isinstance(exc, _NOT_DAMAGE)


def lmdb_damage(path: str) -> str | None:
    """Why the LMDB file at ``path`` cannot be mapped safely, or None if it can (or is absent).

    Only data format 1 (LMDB 0.9) on a 64-bit host is checked; another format is left to LMDB
    and the child's walk.
    """
    if sys.maxsize < 1 << 32:
        return None
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = _meta(f.read(_META_BYTES), 0)
            if not isinstance(first, tuple):
                return first
            psize = first[4]
            if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
                return f"its meta page names a page size of {psize} B"
            f.seek(psize)
            second = _meta(f.read(_META_BYTES), 1)
    except FileNotFoundError:
        return None
    if not isinstance(second, tuple):
        return second or "its two meta pages are of different formats"
    meta = max(first, second, key=lambda m: m[-1])  # LMDB reads the newest transaction's
    last_page = meta[-2]
    if not _NUM_METAS - 1 <= last_page < _NO_PAGE // psize:
        return f"its meta page names page {last_page} as the last"
    needed = (last_page + 1) * psize
    if size < needed:
        return f"it is truncated: {size} B, but its pages in use end at {needed} B"
    for root in (meta[i] for i in _ROOTS):
        if root != _NO_PAGE and not _NUM_METAS <= root <= last_page:
            return f"its meta page names page {root} as a root, past the last page {last_page}"
    return None


def _meta(raw: bytes, page: int) -> tuple[int, ...] | str | None:
    """Meta page ``page`` parsed, a reason it is damaged, or None for another data format."""
    if len(raw) < _META_BYTES:
        return f"it is truncated inside meta page {page}"
    flags = _PAGE_HEADER.unpack_from(raw)[2]
    meta = _META.unpack_from(raw, _PAGE_HEADER.size)
    if not flags & _P_META or meta[0] != _MAGIC:
        return f"meta page {page} is not an LMDB meta page"
    return meta if meta[1] == _DATA_VERSION else None


def verify_in_child(path: str) -> str | None:
    """Walks every database of the LMDB environment at ``path`` in a child process; returns why
    it is damaged (an LMDB error, or the child killed by a signal), or None.

    A child that cannot run at all is logged and taken as no news: the meta check has passed.
    """
    started = time.monotonic()
    try:
        child = subprocess.run(
            [sys.executable, "-c", _WALK, path],
            cwd="/",
            capture_output=True,
            timeout=TUNABLES.disk_verify_timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"reading it did not finish in {TUNABLES.disk_verify_timeout_s:.0f} s"
    except OSError as exc:
        log.warning("disk tier %s: could not start the index check: %s", path, exc)
        return None
    log.debug("disk tier %s: index checked in %.3f s", path, time.monotonic() - started)
    message = child.stderr.decode(errors="replace").strip().splitlines()
    if child.returncode < 0:
        return f"reading it killed a process with {signal.Signals(-child.returncode).name}"
    if child.returncode == 3:
        return f"LMDB reports {message[-1] if message else 'an error'}"
    if child.returncode != 0:
        log.warning(
            "disk tier %s: the index check failed to run (exit %d): %s",
            path,
            child.returncode,
            message[-1] if message else "no message",
        )
    return None


class TierDirectory:
    """The directory at ``path``, made 0700 and held with an exclusive ``flock`` until
    ``release``; raises ``DirectoryInUse`` naming the pid of another holder."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        self._fd = _lock(path)

    def check(self) -> None:
        """Moves a damaged index aside before LMDB maps it (see the module docstring).

        The child's walk is skipped when the index is exactly as this tier's last clean close
        left it (same inode, size and modification time): it runs after a crash, and after
        anything else wrote the file.
        """
        data = os.path.join(self.path, LMDB_FILE)
        clean = self._take_clean_mark()
        if not os.path.exists(data):
            return
        reason = lmdb_damage(data)
        if reason is None and clean != _identity(data):
            reason = verify_in_child(self.path)
        if reason is not None:
            self.move_aside(reason)

    def mark_clean(self) -> None:
        """Notes that the index was closed cleanly (call after closing it, before ``release``)."""
        try:
            note = _identity(os.path.join(self.path, LMDB_FILE))
        except FileNotFoundError:
            return
        mark = os.path.join(self.path, CLEAN_FILE)
        fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(note)

    def _take_clean_mark(self) -> str | None:
        """The clean-close note, removed: from now on a crash must not find it."""
        mark = os.path.join(self.path, CLEAN_FILE)
        try:
            with open(mark) as f:
                note = f.read()
        except FileNotFoundError:
            return None
        os.unlink(mark)
        return note

    def move_aside(self, reason: str) -> str:
        """Renames the directory to a sibling ``<name>.damaged-<UTC time>`` and starts a new,
        empty one here (owned, locked); returns where the old one went.

        The payload file is moved back and reused: without the index it holds nothing, and
        keeping a second one could fill the disk. The damaged index stays for a post-mortem.
        """
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = f"{self.path}{DAMAGED_TAG}{stamp}"
        suffix = 1
        while os.path.exists(aside):
            suffix += 1
            aside = f"{self.path}{DAMAGED_TAG}{stamp}-{suffix}"
        os.rename(self.path, aside)
        os.mkdir(self.path, 0o700)
        old = self._fd
        try:
            self._fd = _lock(self.path)
        finally:
            os.close(old)
        log.warning(
            "disk tier %s: the index is damaged (%s); moved it aside to %s, starting empty",
            self.path,
            reason,
            aside,
        )
        with contextlib.suppress(FileNotFoundError):
            os.rename(os.path.join(aside, DATA_FILE), os.path.join(self.path, DATA_FILE))
        return aside

    def make_private(self) -> None:
        """Mode 0600 for every file here (ones made by older versions were world-readable)."""
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mode & 0o077:
                    os.chmod(entry.path, 0o600)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _identity(path: str) -> str:
    """What changes whenever the file at ``path`` is written, replaced or truncated."""
    st = os.stat(path)
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}\n"


def _lock(path: str) -> int:
    """Takes the directory's lock file and writes this process's pid into it."""
    lock_path = os.path.join(path, LOCK_FILE)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        mine = " (this process)" if holder == str(os.getpid()) else ""
        raise DirectoryInUse(
            f"disk tier directory {path} is in use by process {holder}{mine}; "
            "stop it or give this one another directory"
        ) from None
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
