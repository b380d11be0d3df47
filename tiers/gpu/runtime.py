"""The CUDA runtime library torch loaded, called through ctypes where torch falls short.

Two things need it: page-locking host memory (``pinned``), because torch's own binding cannot
clear a failed call's error, and the copy path's ``cudaMemcpyAsync`` (``cuda_copy``), because
queuing a run through ``Tensor.copy_`` costs the engine's thread several times what the
driver's own call does (``kvtier bench gpu``'s ``engine_thread_sync_ms`` shows it).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence

import torch

from kvtier.tiers.gpu.plan import Run

MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction follows from the pointers (unified addressing)."""


class CudaError(RuntimeError):
    """A CUDA runtime call failed; its error has been cleared."""


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """torch's CUDA runtime library, or None where none is loaded (a build that links it
    statically, or a non-NVIDIA one)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    # torch's own runtime first, should another library have brought a second one
    major = f"libcudart.so.{(torch.version.cuda or '').split('.')[0]}"
    for path in sorted(paths, key=lambda p: not os.path.basename(p).startswith(major)):
        if os.path.basename(path).startswith("libcudart"):
            lib = ctypes.CDLL(path)
            lib.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
            lib.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
            lib.cudaSetDevice.argtypes = (ctypes.c_int,)
            lib.cudaGetErrorString.argtypes = (ctypes.c_int,)
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaMemcpyAsync.argtypes = (
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            )
            return lib
    return None


def copy_runs(
    lib: ctypes.CDLL | None,
    stream: torch.cuda.Stream,
    host: torch.Tensor,
    device: torch.Tensor,
    runs: Sequence[Run],
    to_host: bool,
) -> None:
    """Queues one ``cudaMemcpyAsync`` per run on ``stream`` between flat ``host`` and
    ``device`` buffers, through torch where no runtime library ``lib`` was found; raises
    ``CudaError`` (error cleared) or ``IndexError`` (nothing queued for that run) instead of
    touching bytes outside either buffer."""
    if lib is None:
        with torch.cuda.stream(stream):
            for run in runs:
                h = host[run.host : run.host + run.nbytes]
                d = device[run.device : run.device + run.nbytes]
                (h if to_host else d).copy_(d if to_host else h, non_blocking=True)
        return
    host_ptr, host_end = host.data_ptr(), host.numel()
    dev_ptr, dev_end = device.data_ptr(), device.numel()
    handle, memcpy = stream.cuda_stream, lib.cudaMemcpyAsync
    for run in runs:
        if run.host + run.nbytes > host_end or run.device + run.nbytes > dev_end:
            raise IndexError(f"{run} lies outside {host_end} host / {dev_end} device bytes")
        h, d = host_ptr + run.host, dev_ptr + run.device
        dst, src = (h, d) if to_host else (d, h)
        err = memcpy(dst, src, run.nbytes, MEMCPY_DEFAULT, handle)
        if err:
            lib.cudaGetLastError()
            raise CudaError(f"cudaMemcpyAsync of {run}: {lib.cudaGetErrorString(err).decode()}")
