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
from array import array
from operator import add

import torch

from kvtier.tiers.gpu.plan import Runs

MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction follows from the pointers (unified addressing)."""
SRC_ACCESS_ORDER_STREAM = 1
"""cudaMemcpySrcAccessOrderStream: a batch reads its sources in stream order, as one
``cudaMemcpyAsync`` does."""
BATCH_SINCE = 12080
"""The runtime version that brought ``cudaMemcpyBatchAsync``; 13.0 dropped its ``failIdx``."""


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_STREAM_ORDER = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM)
_FIRST_COPY = (ctypes.c_size_t * 1)(0)


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


class _Batch:
    """Whether a runtime queues a transfer's runs in one ``cudaMemcpyBatchAsync``, and with
    which signature; a runtime that refuses one batch is not asked again."""

    def __init__(self, lib) -> None:
        version = ctypes.c_int(0)
        get_version = getattr(lib, "cudaRuntimeGetVersion", None)
        if get_version is None or get_version(ctypes.byref(version)):
            version.value = 0
        self.fn = (
            getattr(lib, "cudaMemcpyBatchAsync", None) if version.value >= BATCH_SINCE else None
        )
        self.has_fail_index = version.value < 13000
        if self.fn is not None and isinstance(lib, ctypes.CDLL):
            # the address arrays (void ** in the runtime's header) go as 64-bit words, the
            # form a transfer builds them in
            pointers = ctypes.POINTER(ctypes.c_uint64)
            sizes = ctypes.POINTER(ctypes.c_size_t)
            args = [pointers, pointers, sizes, ctypes.c_size_t]
            args += [ctypes.POINTER(_MemcpyAttributes), sizes, ctypes.c_size_t]
            self.fn.argtypes = (*args, *([sizes] if self.has_fail_index else []), ctypes.c_void_p)


@functools.cache
def _batch(lib) -> _Batch:
    return _Batch(lib)


def copy_runs(
    lib: ctypes.CDLL | None,
    stream: torch.cuda.Stream,
    host: torch.Tensor,
    device: torch.Tensor,
    runs: Runs,
    to_host: bool,
) -> None:
    """Queues the runs on ``stream`` between flat ``host`` and ``device`` buffers: in one
    ``cudaMemcpyBatchAsync`` where the runtime has it (one call into the driver for the whole
    transfer), else one ``cudaMemcpyAsync`` per run, and through torch where no runtime
    library ``lib`` was found. Raises ``CudaError`` (error cleared) or ``IndexError`` (nothing
    queued) instead of touching bytes outside either buffer."""
    if lib is None:
        with torch.cuda.stream(stream):
            for run in runs:
                h = host[run.host : run.host + run.nbytes]
                d = device[run.device : run.device + run.nbytes]
                (h if to_host else d).copy_(d if to_host else h, non_blocking=True)
        return
    host_ptr, host_end = host.data_ptr(), host.numel()
    dev_ptr, dev_end = device.data_ptr(), device.numel()
    if len(runs) and (
        max(map(add, runs.host, runs.nbytes)) > host_end
        or max(map(add, runs.device, runs.nbytes)) > dev_end
    ):
        outside = next(
            r for r in runs if r.host + r.nbytes > host_end or r.device + r.nbytes > dev_end
        )
        raise IndexError(f"{outside} lies outside {host_end} host / {dev_end} device bytes")
    batch = _batch(lib)
    if (
        batch.fn is not None
        and len(runs) > 1
        and _copy_batch(lib, batch, stream, host_ptr, dev_ptr, runs, to_host)
    ):
        return
    handle, memcpy = stream.cuda_stream, lib.cudaMemcpyAsync
    for run in runs:
        h, d = host_ptr + run.host, dev_ptr + run.device
        dst, src = (h, d) if to_host else (d, h)
        err = memcpy(dst, src, run.nbytes, MEMCPY_DEFAULT, handle)
        if err:
            lib.cudaGetLastError()
            raise CudaError(f"cudaMemcpyAsync of {run}: {lib.cudaGetErrorString(err).decode()}")


def _copy_batch(
    lib, batch: _Batch, stream, host_ptr: int, dev_ptr: int, runs: Runs, to_host: bool
) -> bool:
    """Queues every run in one batch; False (error cleared, batches off for this runtime) if
    the runtime refuses it, for the caller to queue them one by one: a copy the refused batch
    may have queued already is then queued again, which writes the same bytes."""
    count = len(runs)
    words = ctypes.c_uint64 * count
    hosts = array("Q", [host_ptr + offset for offset in runs.host])
    devs = array("Q", [dev_ptr + offset for offset in runs.device])
    dsts, srcs = (hosts, devs) if to_host else (devs, hosts)
    args = [
        words.from_buffer(dsts),
        words.from_buffer(srcs),
        (ctypes.c_size_t * count).from_buffer(array("Q", runs.nbytes)),
        count,
        ctypes.byref(_STREAM_ORDER),
        _FIRST_COPY,
        1,
    ]
    if batch.has_fail_index:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    if not batch.fn(*args, stream.cuda_stream):
        return True
    lib.cudaGetLastError()
    batch.fn = None
    return False
