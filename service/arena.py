"""The shared-memory arena: the host tier's slab as a file in ``/dev/shm`` every client maps.

The daemon creates ``<arena_dir>/kvtier-<name>-<layout>`` (``/dev/shm`` by default; mode 0600,
so only the daemon's user maps it)
and holds an exclusive ``flock`` on it for its lifetime, so a second daemon of the same name is
refused while a dead one's leftover file is replaced. Each start makes a NEW file (new inode):
a client still writing into the old one after a crash can never touch the new daemon's slots.
The size is checked against the free space of its directory up front, because a tmpfs that is
too small fails later with a bus error on first touch rather than at ``ftruncate``; a dead
daemon's leftover arena of the same name is about to be replaced, so its bytes count as free.
A leftover or removed arena that clients still map keeps its pages until they let go (they do
once their session is lost and no copy of theirs is in flight): until then creating the new
one fails with ``ArenaError`` and the client's next ``Open`` tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


class ArenaError(RuntimeError):
    """The arena cannot be created; the message says how to fix it."""


class Arena:
    """A shared-memory file of ``size`` bytes mapped into this process as a uint8 array."""

    def __init__(self, name: str, size: int, directory: Path = SHM_DIR):
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.path = directory / name
        self.size = size
        _check_space(directory, size, self.path)
        self._fd = self._create()
        try:
            self._map = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.array = np.frombuffer(self._map, dtype=np.uint8)
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise
        log.info("arena %s: %d bytes of shared memory", self.path, size)

    def _create(self) -> int:
        if self.path.exists():
            fd = os.open(self.path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ArenaError(
                    f"{self.path} is held by a running daemon; stop it or pick another --name"
                ) from None
            os.close(fd)
            log.warning("arena %s left by a daemon that died; replacing it", self.path)
            self.path.unlink()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)
            _allocate(fd, self.size, self.path)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        return fd

    def close(self) -> None:
        """Unmaps and removes the file; clients keep their own mappings until they let go."""
        if self._fd < 0:
            return
        del self.array
        try:
            self._map.close()
        except BufferError:
            # A view of the slab is still alive somewhere in this process; the mapping goes
            # when it does. The file is removed either way.
            log.debug("arena %s: mapping still referenced at close", self.path)
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


def _check_space(directory: Path, size: int, replaced: Path) -> None:
    """Raises ``ArenaError`` unless ``directory`` has room for ``size`` bytes once the file
    at ``replaced`` (if any) is gone."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    with contextlib.suppress(FileNotFoundError):
        free += os.stat(replaced).st_blocks * 512
    if size > free:
        raise ArenaError(
            f"{directory} has {free / 2**30:.2f} GiB free but the host tier needs "
            f"{size / 2**30:.2f} GiB: lower --host-bytes, or give the container more shared "
            f"memory (docker run --shm-size={_round_up_gib(size)}g, or a bigger /dev/shm)"
        )


def _allocate(fd: int, size: int, path: Path) -> None:
    """Reserves the pages now, so a full tmpfs fails here rather than with SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise ArenaError(
                f"{path}: {path.parent} cannot hold {size} bytes ({exc.strerror}); lower "
                "--host-bytes or raise the container's --shm-size (clients still mapping a "
                "replaced arena let go of it once their copies have landed)"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _round_up_gib(size: int) -> int:
    return -(-size // 2**30) + 1
