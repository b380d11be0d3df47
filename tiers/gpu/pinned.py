"""Host memory for DMA: exact-size page-aligned allocations, page-locked with cudaHostRegister.

PyTorch's ``pin_memory=True`` goes through its caching host allocator, which rounds every
request up to a power of two (a 24 GiB host tier would lock 32 GiB). kvtier instead maps
exactly the pages it needs (``allocate_host``) and page-locks them with ``cudaHostRegister``
(``register_host``), the same way it locks the daemon's shared-memory arena.

Registration is a CUDA call with rules of its own: it runs on the engine's thread under the
engine's device (any other thread would create a context on its current device, GPU 0 for a
helper thread), in calls of at most 64 GiB (the driver's limit per call) that end on slot and
page boundaries, its errors are checked and cleared (a failed runtime call would otherwise
surface later as the error of an unrelated kernel launch), and a buffer that cannot be locked
is reported loudly: copies from pageable memory are synchronous, so every "async" copy would
stall the engine.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time

import torch

from kvtier.tiers.gpu.runtime import runtime as cuda_runtime

logger = logging.getLogger(__name__)

MAX_REGISTER_BYTES = 64 << 30
"""The CUDA driver's limit on one cudaHostRegister call."""
PAGE_BYTES = mmap.PAGESIZE
_PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every CUDA context, not only the registering one (a
slab shared by engines on several devices of one process)."""

_lock = threading.Lock()
_registered: dict[int, tuple[torch.UntypedStorage, list[int]]] = {}
"""Base address -> (the storage it belongs to, kept alive while locked; chunk addresses)."""


def cuda_present() -> bool:
    return torch.cuda.is_available()


def allocate_host(num_bytes: int, pin: bool | None = None) -> torch.Tensor:
    """An exact-size, page-aligned uint8 host tensor (an anonymous mapping it keeps alive).

    Page alignment lets the disk tier read with O_DIRECT straight into a slot. With
    ``pin=True`` it is page-locked at once on this thread's current device (for benchmarks
    that own their buffers); otherwise a copy engine locks it on first use, on the engine's
    thread and device.
    """
    mapping = mmap.mmap(-1, max(num_bytes, 1))
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)[:num_bytes]
    if pin:
        register_host(buffer, torch.device("cuda", torch.cuda.current_device()), PAGE_BYTES)
    return buffer


def registration_chunk(row_bytes: int, limit: int = MAX_REGISTER_BYTES) -> int:
    """Bytes per cudaHostRegister call: at most ``limit``, a multiple of the page size and of
    ``row_bytes`` (a slot) where both fit, so that no slot straddles two registrations."""
    unit = math.lcm(row_bytes, PAGE_BYTES)
    if unit > limit:
        unit = PAGE_BYTES
    return limit // unit * unit


def registration_ranges(num_bytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) of each registration call for ``num_bytes``."""
    return [(offset, min(chunk, num_bytes - offset)) for offset in range(0, num_bytes, chunk)]


def is_registered(buffer: torch.Tensor) -> bool:
    """True if ``register_host`` locked this buffer's memory (and it was not unregistered)."""
    return buffer.data_ptr() in _registered


def register_host(
    buffer: torch.Tensor, device: torch.device, row_bytes: int, limit: int = MAX_REGISTER_BYTES
) -> bool:
    """Page-locks ``buffer`` (a host mapping) for DMA from ``device``; True once locked.

    Call it on the engine's thread. Failure leaves the buffer pageable, cleared of any CUDA
    error, and is logged as an error: copies still work, synchronously.
    """
    ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if nbytes == 0 or not cuda_present():
        return False
    with _lock:
        if ptr in _registered:
            return True
    runtime = cuda_runtime()
    if runtime is None:
        logger.error(
            "kvtier: the CUDA runtime library is not found in this process; %.2f GiB of host "
            "memory stays pageable and every GPU copy through it is synchronous",
            nbytes / 2**30,
        )
        return False
    started = time.perf_counter()
    chunks: list[int] = []
    with torch.cuda.device(device):
        # Should ``runtime`` be a second copy of the library, torch's device does not reach it.
        runtime.cudaSetDevice(torch.cuda.current_device())
        for offset, length in registration_ranges(nbytes, registration_chunk(row_bytes, limit)):
            err = runtime.cudaHostRegister(ctypes.c_void_p(ptr + offset), length, _PORTABLE)
            if err == 0:
                chunks.append(ptr + offset)
                continue
            runtime.cudaGetLastError()  # clears it, so no later launch reports it as its own
            for address in chunks:
                runtime.cudaHostUnregister(ctypes.c_void_p(address))
            logger.error(
                "kvtier: cudaHostRegister of %.2f GiB at offset %d failed on %s (%s); the host "
                "memory stays pageable and every GPU copy through it is synchronous (a writable "
                "shared mapping of a file on a disk filesystem cannot be page-locked on recent "
                "Linux kernels: keep shared buffers on tmpfs, such as /dev/shm)",
                length / 2**30,
                offset,
                device,
                runtime.cudaGetErrorString(err).decode(),
            )
            return False
    with _lock:
        _registered[ptr] = (buffer.untyped_storage(), chunks)
    logger.info(
        "kvtier: page-locked %.2f GiB of host memory for %s in %d call(s), %.2f s",
        nbytes / 2**30,
        device,
        len(chunks),
        time.perf_counter() - started,
    )
    return True


def unregister_host(ptr: int, device: torch.device) -> None:
    """Undoes ``register_host`` of the buffer at ``ptr``; its memory may then be unmapped."""
    with _lock:
        entry = _registered.pop(ptr, None)
    runtime = cuda_runtime()
    if entry is None or runtime is None:
        return
    with torch.cuda.device(device):
        runtime.cudaSetDevice(torch.cuda.current_device())
        for address in entry[1]:
            if runtime.cudaHostUnregister(ctypes.c_void_p(address)) != 0:
                runtime.cudaGetLastError()
                logger.warning("kvtier: cudaHostUnregister at %#x failed", address)
