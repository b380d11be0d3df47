"""The disk tier's data file: fixed-size block slots in one preallocated file, read and written
around the page cache.

Slot ``i`` holds one block at byte ``i * stride``, where ``stride`` is the block size rounded up
to a whole page. The file is opened with ``O_DIRECT``, so a write goes from our page-aligned
buffer to the device with no copy into the page cache, and a read comes from the device into the
caller's buffer when that buffer is page-aligned (through one of our aligned buffers when it is
not, or for a block's last partial page). Where the filesystem refuses ``O_DIRECT`` (tmpfs) the
same calls go through the page cache instead, and ``direct`` says so.

``BufferPool`` hands out page-aligned buffers of one slot each and keeps a few of those it gets
back: a buffer the kernel has already faulted in is several times faster to fill than a new one.
A new one is backed by transparent huge pages where the kernel offers them (``_new_buffer``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import heapq
import logging
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.tiers.buffers import copy_bytes
from kvtier.tiers.tunables import TUNABLES

log = logging.getLogger(__name__)

DATA_FILE = "blocks.dat"
"""The data file's name in the tier's directory."""
PAGE = 4096
"""Alignment of slot offsets, lengths and buffers for ``O_DIRECT`` (a 4Kn device's block)."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 forces the buffered path (tests set it so)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
HUGE_PAGE = 2 << 20
"""The size of a transparent huge page on x86-64 and most arm64 kernels."""
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def slot_stride(block_bytes: int) -> int:
    """Bytes from one slot to the next: the block rounded up to whole pages."""
    return -(-block_bytes // PAGE) * PAGE


class BufferPool:
    """Page-aligned buffers of ``size`` bytes; keeps up to ``keep`` returned ones for reuse."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self._keep = keep
        self._free: list[memoryview] = []
        self._lock = threading.Lock()
        self._huge = size >= HUGE_PAGE and _huge_pages_offered()

    def acquire(self) -> memoryview:
        with self._lock:
            if self._free:
                return self._free.pop()
        return _new_buffer(self.size, self._huge)

    def release(self, buf: memoryview) -> None:
        """Takes a buffer back. One beyond ``keep`` is dropped (unmapped once unreferenced)."""
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class SlotFile:
    """``slots`` slots of ``stride`` bytes in the file at ``path``, created if missing."""

    def __init__(self, path: str, stride: int, pool: BufferPool) -> None:
        if stride % PAGE or pool.size < stride:
            raise ValueError(f"stride {stride} must be whole pages and fit the pool's buffers")
        self.path = path
        self.stride = stride
        self.created = not os.path.exists(path)
        self._pool = pool
        self._toucher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-touch")
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self.direct = bool(_O_DIRECT)
        try:
            self._fd = os.open(path, flags | _O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False
        if not self.direct:
            log.warning("disk tier data file %s: no O_DIRECT here, using the page cache", path)
            self._fd = os.open(path, flags, 0o600)

    @property
    def slots(self) -> int:
        """How many whole slots the file holds now."""
        return os.fstat(self._fd).st_size // self.stride

    def resize(self, slots: int) -> None:
        """Makes the file exactly ``slots`` slots long, allocating every byte of it on disk
        (so that a full disk shows here, at open, rather than in a later write)."""
        size = slots * self.stride
        if os.fstat(self._fd).st_size > size:
            os.ftruncate(self._fd, size)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                message = f"cannot allocate {size} B: {exc.strerror}"
                raise OSError(exc.errno, message, self.path) from None
            os.ftruncate(self._fd, size)  # no preallocation on this filesystem: a sparse file

    def write(self, writes: Sequence[tuple[int, memoryview]]) -> None:
        """Writes whole slots: ``(slot, buffer of stride bytes)`` pairs, page-aligned buffers.

        Slots that follow each other go out in one ``pwritev``, so that a batch written into
        a fresh file is one long sequential write.
        """
        ordered = sorted(writes, key=lambda w: w[0])
        start = 0
        while start < len(ordered):
            end = start + 1
            while (
                end < len(ordered)
                and end - start < _IOV_MAX
                and ordered[end][0] == ordered[end - 1][0] + 1
            ):
                end += 1
            buffers = [buf for _, buf in ordered[start:end]]
            offset = ordered[start][0] * self.stride
            expected = (end - start) * self.stride
            written = os.pwritev(self._fd, buffers, offset)
            if written != expected:
                raise OSError(errno.EIO, f"short write at {offset}: {written} of {expected} B")
            start = end

    def read_into(self, slot: int, dst: memoryview) -> None:
        """Reads the first ``len(dst)`` bytes of ``slot`` into ``dst`` (a writable byte view)."""
        offset = slot * self.stride
        head = 0
        if not self.direct:
            self._read(dst, offset)
            return
        if _address(dst) % PAGE == 0:
            head = len(dst) - len(dst) % PAGE  # whole pages straight into the caller's buffer
            if head:
                self._read(dst[:head], offset)
        if head < len(dst):
            rest = dst[head:]
            # Faulting in a new buffer's pages costs as much as reading them, so for a large
            # copy a helper thread touches them while this one waits on the device.
            touched = (
                self._toucher.submit(_touch, rest)
                if len(rest) >= TUNABLES.disk_touch_bytes
                else None
            )
            buf = self._pool.acquire()
            try:
                with memoryview(buf) as view:
                    self._read(view[: slot_stride(len(rest))], offset + head)
                    if touched is not None:
                        touched.result()
                    copy_bytes(rest, view[: len(rest)])
            finally:
                self._pool.release(buf)

    def sync(self) -> None:
        """Makes the written slots durable (the device's write cache included)."""
        os.fdatasync(self._fd)

    def close(self) -> None:
        self._toucher.shutdown()
        os.close(self._fd)

    def _read(self, dst: memoryview, offset: int) -> None:
        got = os.preadv(self._fd, [dst], offset)
        if got != len(dst):
            raise OSError(errno.EIO, f"short read at {offset}: {got} of {len(dst)} B")


def _new_buffer(size: int, huge: bool) -> memoryview:
    """``size`` bytes of fresh page-aligned memory, on huge pages where ``huge``.

    A burst of puts fills a new buffer per block, and a new buffer's first fill is mostly the
    kernel's work: on the 2-core VM 2 MiB buffers populated up front (4 KiB pages, zeroed at
    the ``mmap``) filled at 2.8 to 3.1 GB/s, where buffers reused filled at 12.5. On huge
    pages the kernel zeroes and maps one page per 2 MiB: a 256-block burst of puts with its
    durable flush ran at 2.24 to 2.70 GB/s against 1.68 to 1.91 (six runs each, alternated,
    each in a fresh process). A huge page must start on a 2 MiB boundary, which an ``mmap``
    need not, so the mapping is one huge page longer than the buffer and the buffer starts at
    its first boundary; the slack is address space the buffer never touches, so the kernel
    never backs it. Without huge pages, populating up front is cheaper than a fault per page
    on the first fill.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not huge:
        return memoryview(mmap.mmap(-1, size, flags=flags | _MAP_POPULATE))
    mapping = memoryview(mmap.mmap(-1, size + HUGE_PAGE, flags=flags))
    start = -_address(mapping) % HUGE_PAGE
    # The advice is a hint: refused (a kernel built without huge pages, a sandbox), the
    # buffer is still whole, faulted in by small pages on its first fill.
    with contextlib.suppress(OSError):
        mapping.obj.madvise(mmap.MADV_HUGEPAGE, start, size)
    return mapping[start : start + size]


@functools.cache
def _huge_pages_offered() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` gets transparent huge pages here: a Linux kernel
    with them that honours the advice ("always" or "madvise", not "never")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def _touch(view: memoryview) -> None:
    """Writes one byte in each page of ``view``, so that the kernel maps them all."""
    view[::PAGE] = bytes(len(range(0, len(view), PAGE)))


def _address(view: memoryview) -> int:
    """The memory address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class SlotTable:
    """Which slots are free and which are being read; it shares the tier's ``lock``.

    A reader pins the slot it found in the index in the same critical section as the lookup
    (``pin_locked``), and the writer frees slots under the same lock only after the commit
    that deleted their entries. So a reader either missed the entry or holds a pin, and a slot
    freed while pinned becomes free only when its last reader unpins it: a read never meets
    another block's bytes. Free slots come lowest first, so fresh writes run sequentially.
    """

    def __init__(self, lock: threading.Lock, free: Iterable[int]) -> None:
        self._freed = threading.Condition(lock)
        self._free = sorted(free)  # a sorted list is a heap
        self._readers: dict[int, int] = {}
        self._retired: set[int] = set()  # freed while pinned

    def pin_locked(self, slot: int) -> None:
        """Pins a slot for a read; call with the lock held."""
        self._readers[slot] = self._readers.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        with self._freed:
            readers = self._readers.pop(slot) - 1
            if readers:
                self._readers[slot] = readers
            elif slot in self._retired:
                self._retired.discard(slot)
                heapq.heappush(self._free, slot)
                self._freed.notify()

    def take(self) -> int:
        """The lowest free slot, waiting for a pinned one's readers if none is free."""
        with self._freed:
            while not self._free:
                assert self._retired, "no slot is free or being freed: spare slots miscounted"
                self._freed.wait()
            return heapq.heappop(self._free)

    def free(self, slots: Iterable[int]) -> None:
        """Makes slots reusable (a pinned one once its last reader is done)."""
        with self._freed:
            for slot in slots:
                if slot in self._readers:
                    self._retired.add(slot)
                else:
                    heapq.heappush(self._free, slot)
            self._freed.notify()
