"""Host memory for DMA: exact-size allocations, registration chunks, and who may lock memory."""

from __future__ import annotations

import mmap
import threading

import torch

from kvtier.connector.client.arena import ArenaView
from kvtier.tiers.gpu import pinned
from kvtier.tiers.gpu.pinned import (
    MAX_REGISTER_BYTES,
    PAGE_BYTES,
    allocate_host,
    registration_chunk,
    registration_ranges,
)


def test_host_allocation_is_exact_and_page_aligned():
    """Defect: pin_memory=True rounded a host tier up to a power of two (24 GiB locked 32)."""
    size = 3 * PAGE_BYTES + 123
    buffer = allocate_host(size)
    assert buffer.numel() == size and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % PAGE_BYTES == 0
    assert not pinned.is_registered(buffer)  # locked later, by the engine's thread
    buffer[-1] = 7  # the whole size is writable


def test_registration_calls_stay_under_the_driver_limit_on_slot_and_page_bounds():
    """Defect: one cudaHostRegister of the whole slab (the driver refuses more than 64 GiB)."""
    block = 2 << 20
    chunk = registration_chunk(block)
    assert chunk == MAX_REGISTER_BYTES  # 2 MiB slots tile 64 GiB exactly
    ranges = registration_ranges(150 << 30, chunk)
    assert [length for _, length in ranges] == [64 << 30, 64 << 30, 22 << 30]
    odd = 3 * 1000 * 1000 + 8  # a slot size sharing little with the page size
    chunk = registration_chunk(odd)
    assert chunk <= MAX_REGISTER_BYTES and chunk % odd == 0 and chunk % PAGE_BYTES == 0
    assert registration_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]


def test_arena_mapping_makes_no_cuda_call(tmp_path, monkeypatch):
    """Defect: the client's background thread page-locked the arena (a context on GPU 0).

    Pretend CUDA is present and record every call into its runtime: mapping the arena on a
    helper thread, as the daemon client does, must make none.
    """
    calls: list[str] = []

    class Recorder:
        def __getattr__(self, name):
            calls.append(name)
            return lambda *args: 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", Recorder)
    monkeypatch.setattr(pinned, "register_host", lambda *a, **k: calls.append("register"))
    path = tmp_path / "arena"
    path.write_bytes(bytes(8 * PAGE_BYTES))
    arena = ArenaView(PAGE_BYTES)
    slab = arena.slab
    thread = threading.Thread(target=arena.map, args=(str(path), 8 * PAGE_BYTES, 8))
    thread.start()
    thread.join()
    assert calls == []
    assert arena.slab is slab and slab.shape == (8, PAGE_BYTES)
    slab[3].fill_(5)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as seen:
        assert seen[3 * PAGE_BYTES] == 5  # the slab is the shared file itself


def test_arena_remap_repoints_the_same_slab(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_bytes(bytes([1]) * (4 * PAGE_BYTES))
    second.write_bytes(bytes([2]) * (4 * PAGE_BYTES))
    arena = ArenaView(PAGE_BYTES)
    slab = arena.slab
    arena.map(str(first), 4 * PAGE_BYTES, 4)
    old = slab[0]  # a view keeps the mapping it was taken of
    arena.map(str(second), 4 * PAGE_BYTES, 4)
    assert int(slab[0, 0]) == 2 and int(old[0]) == 1
    arena.unmap()
    assert slab.shape == (0, PAGE_BYTES)
