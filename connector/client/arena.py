"""The client's view of the daemon's shared-memory arena: a slab tensor re-pointed in place.

``slab`` is ONE tensor object for the client's lifetime. Before the first connection it is an
empty ``[0, block_bytes]`` tensor that no slot id can index; each mapping (the first, and a new
daemon's arena after a restart) re-points it with ``Tensor.set_``. The copy engine reads the
slab afresh for every transfer, so build it once and let it follow; a view taken of the slab
keeps seeing the mapping it was taken of.

Nothing here calls CUDA: mapping happens on the client's background thread, and page-locking
(``cudaHostRegister``) must happen on the engine's thread under the engine's device, so the
copy engine locks each new mapping on its next transfer and unlocks the old one, which is
unmapped once nothing refers to it.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)


class ArenaView:
    """``slab``: uint8 ``[num_slots, block_bytes]`` over the daemon's arena once mapped."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.slab = torch.empty((0, block_bytes), dtype=torch.uint8)
        self.path: str | None = None

    def map(self, path: str, arena_bytes: int, num_slots: int) -> None:
        """Maps ``path`` and points ``slab`` at it. Call only with no slot in use."""
        if num_slots * self.block_bytes > arena_bytes:
            raise ValueError(
                f"{num_slots} slots of {self.block_bytes} B exceed the {arena_bytes} B arena"
            )
        if self.path is not None and num_slots != self.slab.shape[0]:
            raise ValueError(
                f"the daemon's arena changed from {self.slab.shape[0]} to {num_slots} "
                "slots; restart the engine to use it"
            )
        fd = os.open(path, os.O_RDWR)
        try:
            # MAP_POPULATE maps every page now, so the first copy into a slot does not
            # pay a page fault per 4 KiB in the engine's hot path.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, arena_bytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        flat = torch.frombuffer(mapping, dtype=torch.uint8)[: num_slots * self.block_bytes]
        view = flat.view(num_slots, self.block_bytes)
        # The old storage (and with it the old mapping) goes when its last reference does:
        # the copy engine holds it while it keeps that mapping page-locked.
        self.slab.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        remapped = self.path is not None
        self.path = path
        log.info(
            "%s arena %s: %d slots of %d B",
            "re-mapped" if remapped else "mapped",
            path,
            num_slots,
            self.block_bytes,
        )

    def unmap(self) -> None:
        """Points ``slab`` back at nothing. Call only with no slot in use."""
        self.slab.set_(torch.empty((0, self.block_bytes), dtype=torch.uint8))
        self.path = None
