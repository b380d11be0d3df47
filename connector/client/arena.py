"""The client's view of the daemon's shared-memory arena: a slab tensor re-pointed in place.

``slab`` is ONE tensor object for the client's lifetime. Before the first connection it is an
empty ``[0, block_bytes]`` tensor that no slot id can index; each mapping (the first, and a new
daemon's arena after a restart) re-points it with ``Tensor.set_``. The copy engine reads the
slab afresh for every transfer, so build it once and let it follow; a view taken of the slab
keeps seeing the mapping it was taken of.

Mapping, page-locking and letting go all happen on the session keeper's thread, before the
session that uses the mapping is published and after every slot of the last one is handed
back, so the engine's thread never waits for them. Page-locking is the engine's to define
(``cudaHostRegister`` under its device): it hands the view a pair of functions
(``page_lock_with``) that run on every mapping as it is made and before it goes.

A mapping of an arena the daemon no longer has (it stopped, or a new daemon replaced the file)
is the only thing that keeps that arena's pages: the keeper lets go of it (``stale``,
``unmap``) as soon as no slot is in use, so that a restarted daemon finds room for its new
arena.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

PageLock = Callable[[torch.Tensor], bool]
"""Page-locks a mapping (the slab over it); True once locked."""
PageUnlock = Callable[[torch.Tensor], None]


class ArenaView:
    """``slab``: uint8 ``[num_slots, block_bytes]`` over the daemon's arena once mapped."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.slab = torch.empty((0, block_bytes), dtype=torch.uint8)
        self.path: str | None = None
        self.page_locked = False
        self._file: tuple[int, int] | None = None  # (device, inode) of the mapped file
        self._num_slots: int | None = None  # of the first mapping: every later one must agree
        self._lock = threading.Lock()
        self._page_lock: tuple[PageLock, PageUnlock] | None = None

    def page_lock_with(self, lock: PageLock, unlock: PageUnlock) -> None:
        """Locks every mapping with ``lock`` as it is made and unlocks it with ``unlock``
        before it goes; the mapping of now, if any, is locked at once on this thread."""
        with self._lock:
            self._page_lock = (lock, unlock)
            if self.path is not None and not self.page_locked:
                self.page_locked = lock(self.slab)

    def maps(self, path: str) -> bool:
        """Whether the slab is over the file now at ``path``."""
        return self._file is not None and self.path == path and _identity(path) == self._file

    @property
    def stale(self) -> bool:
        """Whether the slab is over a file that is no longer at its path (the daemon removed
        or replaced it): this mapping alone keeps that arena's pages."""
        return self.path is not None and _identity(self.path) != self._file

    def map(self, path: str, arena_bytes: int, num_slots: int) -> None:
        """Lets go of the mapping of now, maps ``path`` and points ``slab`` at it, page-locked
        if ``page_lock_with`` asked for it. Call only with no slot in use."""
        if num_slots * self.block_bytes > arena_bytes:
            raise ValueError(
                f"{num_slots} slots of {self.block_bytes} B exceed the {arena_bytes} B arena"
            )
        if self._num_slots is not None and num_slots != self._num_slots:
            raise ValueError(
                f"the daemon's arena changed from {self._num_slots} to {num_slots} "
                "slots; restart the engine to use it"
            )
        with self._lock:
            remapped = self._release()
            fd = os.open(path, os.O_RDWR)
            try:
                identity = _identity_of(os.fstat(fd))
                # MAP_POPULATE maps every page now, so the first copy into a slot does not
                # pay a page fault per 4 KiB in the engine's hot path.
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapping = mmap.mmap(fd, arena_bytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping keeps the file alive
            flat = torch.frombuffer(mapping, dtype=torch.uint8)[: num_slots * self.block_bytes]
            view = flat.view(num_slots, self.block_bytes)
            self.slab.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
            self.path, self._file, self._num_slots = path, identity, num_slots
            if self._page_lock is not None:
                self.page_locked = self._page_lock[0](self.slab)
        log.info(
            "%s arena %s: %d slots of %d B%s",
            "re-mapped" if remapped else "mapped",
            path,
            num_slots,
            self.block_bytes,
            ", page-locked" if self.page_locked else "",
        )

    def unmap(self) -> None:
        """Unlocks and unmaps the mapping of now, if any. Call only with no slot in use."""
        with self._lock:
            path = self.path
            if self._release():
                log.info("let go of arena %s", path)

    def _release(self) -> bool:
        """``unmap`` with the lock held; True if there was a mapping."""
        if self.path is None:
            return False
        if self.page_locked:
            self._page_lock[1](self.slab)
            self.page_locked = False
        # The old storage, and with it the mapping, goes when its last reference does.
        self.slab.set_(torch.empty((0, self.block_bytes), dtype=torch.uint8))
        self.path, self._file = None, None
        return True


def _identity(path: str) -> tuple[int, int] | None:
    try:
        return _identity_of(os.stat(path))
    except OSError:
        return None


def _identity_of(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino
