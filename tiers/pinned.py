"""Page-locking host memory for DMA when CUDA is present; plain memory otherwise."""

from __future__ import annotations

import logging
import mmap

import torch

logger = logging.getLogger(__name__)


def cuda_present() -> bool:
    return torch.cuda.is_available()


def allocate_host(num_bytes: int, pin: bool | None = None) -> torch.Tensor:
    """A page-aligned uint8 host tensor, page-locked when ``pin`` (default: with CUDA).

    Page alignment lets the disk tier read with O_DIRECT straight into a slot. CUDA's pinned
    allocations are page-aligned already; otherwise the memory is an anonymous mapping (the
    tensor keeps it alive).
    """
    pin = cuda_present() if pin is None else pin
    if pin:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return torch.frombuffer(mmap.mmap(-1, max(num_bytes, 1)), dtype=torch.uint8)[:num_bytes]


def register_pinned(buffer: torch.Tensor) -> bool:
    """Page-locks an existing host buffer (a shared-memory mapping) with ``cudaHostRegister``.

    Returns False, and leaves the buffer pageable, when CUDA is absent or refuses; copies then
    still work, only without DMA straight from the buffer.
    """
    if not cuda_present() or buffer.is_pinned():
        return buffer.is_pinned() if cuda_present() else False
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister of %d bytes failed (%r); copies stay pageable", buffer.numel(), err
        )
        return False
    return True


def unregister_pinned(buffer: torch.Tensor) -> None:
    """Undoes ``register_pinned`` before the mapping goes away."""
    if cuda_present():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
