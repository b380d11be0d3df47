"""Physical limits measured in the same run as a benchmark: memcpy and raw disk bandwidth."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from kvtier.tiers.gpu.cpu_copy import copy_rows
from kvtier.tiers.tunables import TUNABLES

GB = 1e9


def best_seconds(fn: Callable[[], None], repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs of ``fn``: the least disturbed by other work."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_gbps(num_bytes: int = 512 << 20, row_bytes: int = 2 << 20) -> float:
    """Host-to-host copy bandwidth: the ceiling for any copy of block bytes in memory.

    The better of one large ``copy_`` and the same bytes copied in ``row_bytes`` rows spread
    over threads (``copy_rows``), so that no path measured against it can look faster than it.
    """
    src = torch.randint(0, 256, (num_bytes // row_bytes, row_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    rows = range(src.shape[0])
    whole = best_seconds(lambda: dst.copy_(src))
    by_rows = best_seconds(lambda: copy_rows(dst.numpy(), rows, src.numpy(), rows))
    return src.numel() / min(whole, by_rows) / GB


def _aligned(num_bytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as O_DIRECT needs."""
    buf = mmap.mmap(-1, num_bytes)
    buf.write(os.urandom(1 << 20) * (num_bytes >> 20))
    buf.write(os.urandom(num_bytes % (1 << 20)))  # every page written: none is the zero page
    return buf


def drop_page_cache(path: str) -> None:
    """Evicts a file's pages from the page cache so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_disk_gbps(directory: str, num_bytes: int, chunk: int = 2 << 20) -> tuple[float, float, str]:
    """Sequential O_DIRECT write (with a final fsync) and read of ``num_bytes`` in ``directory``,
    each ``chunk`` from and into page-aligned memory of its own. The writes go out
    ``TUNABLES.disk_stage_bytes`` at a time, as the disk tier writes its payloads, each a
    ``writev`` of its chunks: on the 2-core VM's virtual disk 2 MiB writes ran at 1.95 to
    2.6 GB/s where 16 MiB writes ran at 2.5 to 3.4 (four rounds), and a limit written slower
    than the tier writes is none.

    A tier moves each block between the device and memory of its own (a host slot, a pooled
    buffer), never through the same few pages over and over, and so does this limit. On the
    2-core VM's virtual disk, 2 MiB reads of one file into one reused buffer ran at 2.2 to
    2.5 GB/s and the same reads into 256 distinct buffers at 1.7: a limit measured through
    one buffer is one no tier can reach (the disk tier's cold read was 0.6 of it).

    Returns (write GB/s, read GB/s, how). Where the filesystem refuses O_DIRECT (tmpfs), it
    falls back to buffered I/O with fsync and a dropped page cache, and says so in ``how``.
    """
    path = os.path.join(directory, "kvtier-raw-probe")
    count = max(1, num_bytes // chunk)
    buf = _aligned(count * chunk)
    view = memoryview(buf)
    pieces = [view[i * chunk : (i + 1) * chunk] for i in range(count)]
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
            how = "O_DIRECT"
        except OSError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            how = "buffered+fsync"
        per_write = max(1, TUNABLES.disk_stage_bytes // chunk)
        start = time.perf_counter()
        for first in range(0, count, per_write):
            run = pieces[first : first + per_write]
            if os.writev(fd, run) != len(run) * chunk:
                raise OSError(f"a short write to {path}")
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.close(fd)
        drop_page_cache(path)
        read_s = read_slots(path, pieces, chunk)
    finally:
        for piece in pieces:
            piece.release()
        view.release()
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    moved = count * chunk
    return moved / write_s / GB, moved / read_s / GB, how


def read_slots(path: str, rows: Sequence[memoryview] | np.ndarray, stride: int) -> float:
    """Seconds to read slot ``i`` (``stride`` bytes apart) of the file at ``path`` into
    ``rows[i]``, in order, with O_DIRECT (through the page cache where the filesystem refuses
    it): the raw read limit's, and the raw read of a tier's own bytes. ``rows`` are
    page-aligned writable buffers."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        for i, row in enumerate(rows):
            if os.preadv(fd, [row], i * stride) != row.nbytes:
                raise OSError(f"{path}: a short read of slot {i}")
        return time.perf_counter() - start
    finally:
        os.close(fd)


@contextmanager
def disk_writing(directory: str, span: int = 256 << 20, chunk: int = 2 << 20) -> Iterator[None]:
    """Sequential O_DIRECT writes to a scratch file in ``directory``, round and round on
    another thread, while the block runs: the traffic of a disk tier draining at the device's
    speed, for limits measured beside it."""
    path = os.path.join(directory, "kvtier-busy-probe")
    buf = _aligned(chunk)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # no O_DIRECT here (tmpfs): page-cache writes
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    stop = threading.Event()

    def write() -> None:
        offset = 0
        while not stop.is_set():
            os.pwrite(fd, buf, offset)
            offset = (offset + chunk) % span

    writer = threading.Thread(target=write, name="kvtier-busy-disk", daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()
        os.close(fd)
        os.unlink(path)
        buf.close()
