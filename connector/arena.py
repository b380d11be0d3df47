"""The client's view of the daemon's shared-memory arena, re-pointable in place.

The copy engine keeps the ``slab`` tensor it was built with (and views of it), so when the
daemon restarts (and with it makes a new arena file of the same size) the client maps the new
file over the old one at the SAME address (``MAP_FIXED``): every tensor and numpy view stays
valid and now sees the new arena. Before the first connection the slab is an empty
``[0, block_bytes]`` tensor that no slot id can index; the first mapping re-points that tensor
with ``Tensor.set_``, so build the engine's stack after ``wait_connected`` (a view taken of the
empty slab stays empty).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from kvtier.tiers.pinned import register_pinned, unregister_pinned

log = logging.getLogger(__name__)

_MAP_FIXED = 0x10  # Linux
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_size_t
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)


class ArenaView:
    """``slab``: uint8 ``[num_slots, block_bytes]`` over the daemon's arena once mapped."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.slab = torch.empty((0, block_bytes), dtype=torch.uint8)
        self.path: str | None = None
        self._pinned = False

    def map(self, path: str, arena_bytes: int, num_slots: int) -> None:
        """Maps ``path`` and points ``slab`` at it. Call only with no slot in use."""
        if num_slots * self.block_bytes > arena_bytes:
            raise ValueError(
                f"{num_slots} slots of {self.block_bytes} B exceed the {arena_bytes} B arena"
            )
        if self.path is not None:
            if num_slots != self.slab.shape[0]:
                raise ValueError(
                    f"the daemon's arena changed from {self.slab.shape[0]} to {num_slots} "
                    "slots; restart the engine to use it"
                )
            self._replace(path)
            return
        fd = os.open(path, os.O_RDWR)
        try:
            # MAP_POPULATE maps every page now, so the first copy into a slot does not
            # pay a page fault per 4 KiB in the engine's hot path.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, arena_bytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        flat = torch.frombuffer(mapping, dtype=torch.uint8)[: num_slots * self.block_bytes]
        self.unmap()
        view = flat.view(num_slots, self.block_bytes)
        # The old storage (and with it the old mapping) goes when its last view does.
        self.slab.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        self._pinned = num_slots > 0 and register_pinned(flat)
        self.path = path
        log.info(
            "mapped arena %s: %d slots of %d B%s",
            path,
            num_slots,
            self.block_bytes,
            " (pinned)" if self._pinned else "",
        )

    def _replace(self, path: str) -> None:
        """Maps ``path`` over the current mapping, in place, at the same address."""
        nbytes = self.slab.numel()
        if self._pinned:
            unregister_pinned(self.slab)
        fd = os.open(path, os.O_RDWR)
        try:
            addr = _libc.mmap(
                ctypes.c_void_p(self.slab.data_ptr()),
                ctypes.c_size_t(nbytes),
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED | _MAP_FIXED | getattr(mmap, "MAP_POPULATE", 0),
                fd,
                ctypes.c_long(0),
            )
        finally:
            os.close(fd)
        if addr != self.slab.data_ptr():
            raise OSError(ctypes.get_errno(), f"mmap MAP_FIXED of {path} failed")
        self._pinned = register_pinned(self.slab)
        self.path = path
        log.info("re-mapped arena %s in place", path)

    def unmap(self) -> None:
        """Points ``slab`` back at nothing. Call only with no slot in use."""
        if self._pinned:
            unregister_pinned(self.slab)
            self._pinned = False
        self.slab.set_(torch.empty((0, self.block_bytes), dtype=torch.uint8))
        self.path = None
