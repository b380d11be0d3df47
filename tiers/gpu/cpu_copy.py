"""Block copies on a CPU: synchronous memcpy runs, and row copies for other page orders.

On a CPU, numpy's copy of a few MiB runs at memcpy speed, while torch's ``index_copy_`` and
``copy_`` on uint8 rows run several times slower (``kvtier bench tiers`` compares them with
memcpy); numpy releases the GIL
while it copies, so a large batch is split across a few threads, as one core alone cannot
saturate memory bandwidth. Nothing here allocates per transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.gpu.plan import Runs
from kvtier.tiers.tunables import TUNABLES


def copy_rows(
    dst: np.ndarray, dst_rows: Iterable[int], src: np.ndarray, src_rows: Iterable[int]
) -> None:
    """Copies whole rows between 2-D host arrays, one memcpy per row."""
    width = dst.shape[1]
    runs = [(d * width, s * width, width) for d, s in zip(dst_rows, src_rows, strict=True)]
    copy_ranges(dst.reshape(-1), src.reshape(-1), runs)


def copy_ranges(dst: np.ndarray, src: np.ndarray, runs: Sequence[tuple[int, int, int]]) -> None:
    """Copies ``(dst_offset, src_offset, nbytes)`` ranges between flat byte arrays."""
    threads = torch.get_num_threads()
    total = sum(n for _, _, n in runs)
    if threads < 2 or len(runs) < 2 or total < TUNABLES.parallel_copy_bytes:
        _copy(dst, src, runs)
        return
    parts = [runs[i::threads] for i in range(threads)]
    list(_copy_pool().map(lambda part: _copy(dst, src, part), parts))


def _copy(dst: np.ndarray, src: np.ndarray, runs: Sequence[tuple[int, int, int]]) -> None:
    for d, s, n in runs:
        np.copyto(dst[d : d + n], src[s : s + n])


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="kvtier-copy")


def store_runs(placement: KVPlacement, slab: torch.Tensor, runs: Runs) -> None:
    """Device runs into the slab (both in host memory)."""
    dev, host = placement.buffer.numpy(), slab.numpy().reshape(-1)
    copy_ranges(host, dev, list(zip(runs.host, runs.device, runs.nbytes, strict=True)))


def load_runs(placement: KVPlacement, slab: torch.Tensor, runs: Runs) -> None:
    """Slab runs into the device buffer (both in host memory)."""
    dev, host = placement.buffer.numpy(), slab.numpy().reshape(-1)
    copy_ranges(dev, host, list(zip(runs.device, runs.host, runs.nbytes, strict=True)))


def store_rows(
    placement: KVPlacement, slab: torch.Tensor, block_ids: Sequence[int], slots: Sequence[int]
) -> None:
    """Blocks of a non-canonical page order into slots, one strided row copy per block.

    Page padding is zeroed, so a block's bytes do not depend on what its slot held before.
    """
    lay = placement.layout
    for block, slot in zip(block_ids, slots, strict=True):
        placement.row_pages(slab[slot]).copy_(placement.block_pages(block))
        if lay.page_stride != lay.page_bytes:
            slab[slot].view(lay.num_layers, lay.page_stride)[:, lay.page_bytes :].zero_()


def load_rows(
    placement: KVPlacement, slab: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]
) -> None:
    """Slots into blocks of a non-canonical page order, one strided row copy per block."""
    for slot, block in zip(slots, block_ids, strict=True):
        placement.block_pages(block).copy_(placement.row_pages(slab[slot]))
