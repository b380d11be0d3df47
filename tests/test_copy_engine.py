"""The copy path's planning on a CPU: runs, chunks, the ring's bounds, who owns what and when."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.cpu_copy import copy_rows
from kvtier.tiers.gpu.cuda_copy import PinnedIds, StagingRing
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.gpu.plan import Run, Runs, check_pairs, chunk_ranges, plan_runs
from kvtier.tiers.gpu.runtime import MEMCPY_DEFAULT, SRC_ACCESS_ORDER_STREAM, copy_runs
from kvtier.tiers.gpu.transfer import CompletionQueue, Transfer
from kvtier.tiers.layout import KVLayout

LAYOUT = KVLayout(2, 2, 8, 4, torch.float16)
LLAMA_8B = KVLayout(32, 8, 128, 16, torch.bfloat16)


class Flag:
    """A stand-in for a CUDA event: done when the test says so."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired


def filled(order: str, layout: KVLayout = LAYOUT, blocks: int = 8) -> KVPlacement:
    placement = KVPlacement.allocate(layout, blocks, order=order)
    gen = torch.Generator().manual_seed(len(order))
    placement.buffer.copy_(
        torch.randint(0, 256, placement.buffer.shape, dtype=torch.uint8, generator=gen)
    )
    return placement


def test_runs_merge_consecutive_blocks_into_consecutive_slots():
    bb = 100
    runs = plan_runs([0, 100, 200, 500, 600, 900], [300, 400, 500, 0, 100, 700], bb)
    assert list(runs) == [Run(0, 300, 300), Run(500, 0, 200), Run(900, 700, 100)]
    assert runs == Runs([0, 500, 900], [300, 0, 700], [300, 200, 100])
    # consecutive slots but scattered blocks (or the reverse) do not merge
    assert len(plan_runs([0, 200, 400], [0, 100, 200], bb)) == 3
    assert len(plan_runs([200, 100, 0], [0, 100, 200], bb)) == 3
    assert len(plan_runs([], [], bb)) == 0


def test_runs_never_cross_a_host_registration_boundary():
    runs = plan_runs([0, 100, 200, 300], [0, 100, 200, 300], 100, host_boundary=200)
    assert list(runs) == [Run(0, 0, 200), Run(200, 200, 200)]


def test_chunks_and_pair_checks():
    assert chunk_ranges(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert chunk_ranges(0, 2) == []
    with pytest.raises(ValueError):
        chunk_ranges(3, 0)
    with pytest.raises(ValueError, match="matching"):
        check_pairs([1, 2], [3], 8, 8)
    with pytest.raises(ValueError, match="block ids"):
        check_pairs([8], [0], 8, 8)
    with pytest.raises(ValueError, match="slots"):
        check_pairs([0], [-1], 8, 8)


@pytest.mark.parametrize("order", ["BLHNC", "LBHNC", "LBNHC"])
@pytest.mark.parametrize("padded", [False, True])
def test_cpu_engine_round_trip_in_every_order(order, padded):
    layout = KVLayout(2, 2, 8, 4, torch.float16, page_size_padded=272 if padded else None)
    src = filled(order, layout)
    slab = torch.full((6, layout.block_bytes), 0xAB, dtype=torch.uint8)
    engine = CopyEngine(src, slab)
    assert engine.staging_bytes == 0
    done: list[str] = []
    stored = engine.store([3, 4, 5, 1], [2, 3, 4, 0], callback=lambda: done.append("stored"))
    assert stored.done() and done == ["stored"]
    want = torch.empty((4, layout.block_bytes), dtype=torch.uint8)
    src.gather(torch.tensor([3, 4, 5, 1]), want)
    for i, slot in enumerate([2, 3, 4, 0]):
        pages = slab[slot].view(layout.num_layers, layout.page_stride)
        assert torch.equal(
            pages[:, : layout.page_bytes], want[i].view(2, -1)[:, : layout.page_bytes]
        )
        if padded and order != "BLHNC":
            assert not pages[:, layout.page_bytes :].any()  # no stale bytes of the slot's past
    dst = KVPlacement.allocate(layout, 8, order=order)
    engine = CopyEngine(dst, slab)
    engine.load([2, 3, 4, 0], [0, 1, 2, 7], callback=lambda: done.append("loaded"))
    assert done == ["stored", "loaded"]
    got = torch.empty_like(want)
    dst.gather(torch.tensor([0, 1, 2, 7]), got)
    for i in range(4):
        ours, theirs = got[i].view(2, -1), want[i].view(2, -1)
        assert torch.equal(ours[:, : layout.page_bytes], theirs[:, : layout.page_bytes])


def test_cpu_engine_refuses_bad_pairs_and_slabs():
    placement = filled("BLHNC")
    with pytest.raises(ValueError, match="slab"):
        CopyEngine(placement, torch.zeros((4, 7), dtype=torch.uint8))
    engine = CopyEngine(placement, torch.zeros((4, LAYOUT.block_bytes), dtype=torch.uint8))
    with pytest.raises(ValueError, match="slots"):
        engine.store([0], [4])
    with pytest.raises(ValueError, match="block ids"):
        engine.load([0], [8])


def test_copy_rows():
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    b = np.zeros_like(a)
    copy_rows(b, [2, 0], a, [0, 1])
    assert b.tolist() == [[4, 5, 6, 7], [0, 0, 0, 0], [0, 1, 2, 3]]


def test_copy_rows_large_batches_go_parallel_and_stay_exact():
    rows, width = 12, 1 << 20  # 12 MiB: above the threshold for the threaded path
    src = np.random.default_rng(0).integers(0, 256, (rows, width), dtype=np.uint8)
    dst = np.zeros((rows + 3, width), dtype=np.uint8)
    order = list(np.random.default_rng(1).permutation(rows + 3)[:rows])
    copy_rows(dst, order, src, range(rows))
    for i, d in enumerate(order):
        assert np.array_equal(dst[d], src[i])
    untouched = set(range(rows + 3)) - set(order)
    assert all(not dst[u].any() for u in untouched)


def test_a_finished_load_does_not_wait_behind_a_store():
    """Defect: one FIFO across both streams held a finished load behind a larger store."""
    order: list[str] = []
    stores, loads = CompletionQueue(), CompletionQueue()
    store_done, load_done = Flag(), Flag()
    stores.push(Transfer(64, 1, lambda: order.append("store"), done_event=store_done))
    loads.push(Transfer(1, 1, lambda: order.append("load"), done_event=load_done))
    load_done.fired = True
    assert loads.poll() + stores.poll() == 1 and order == ["load"]
    store_done.fired = True
    assert stores.poll() == 1 and order == ["load", "store"]


def test_one_stream_completes_in_order():
    order: list[int] = []
    queue = CompletionQueue()
    flags = [Flag() for _ in range(3)]
    for i, flag in enumerate(flags):
        queue.push(Transfer(1, 1, lambda i=i: order.append(i), done_event=flag))
    flags[1].fired = True
    assert queue.poll() == 0  # the stream's earlier copy has not landed
    flags[0].fired = True
    assert queue.poll() == 2 and order == [0, 1]


def test_a_transfer_owns_its_id_buffer_until_done():
    """Defect: block ids a side stream still read were freed when the call returned."""
    pool = PinnedIds(pin=False)
    ids = pool.take([7, 3, 5])
    assert ids[:3].tolist() == [7, 3, 5]
    flag = Flag()
    queue = CompletionQueue()
    queue.push(Transfer(3, 1, done_event=flag, release=lambda: pool.give(ids)))
    other = pool.take([1, 2])
    assert other.data_ptr() != ids.data_ptr()  # still owned by the transfer in flight
    assert queue.poll() == 0 and ids[:3].tolist() == [7, 3, 5]
    flag.fired = True
    queue.poll()
    assert pool.take([9]).data_ptr() == ids.data_ptr()  # handed back only now, and reused


def test_id_buffers_are_allocated_before_the_first_transfer(monkeypatch):
    """A pinned allocation on the engine's step is a CUDA call that may synchronize: the
    buffers a copier's transfers take in flight exist from the start."""
    pool = PinnedIds(pin=False, ready=2, capacity=100)
    allocations = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a) or empty(*a, **k))
    first, second = pool.take(list(range(100))), pool.take([5])
    assert allocations == [] and first.data_ptr() != second.data_ptr()
    pool.take([1])  # a third in flight at once: only now one more buffer
    assert len(allocations) == 1


def test_staging_ring_is_fixed_and_a_long_hit_is_chunked_within_it():
    """Defect: each transfer allocated n x block_bytes of staging (12 GiB for 100k tokens)."""
    placement = KVPlacement.allocate(LLAMA_8B, 1, order="LBHNC")
    ring = StagingRing(placement, 64 << 20)
    assert ring.slot_blocks == 16  # 32 MiB per slot of 2 MiB blocks
    assert ring.nbytes == 2 * 16 * LLAMA_8B.block_bytes + 1 * 8  # one id per KV block
    blocks = 100_000 // LLAMA_8B.block_size
    chunks = chunk_ranges(blocks, ring.slot_blocks)
    assert sum(len(c) for c in chunks) == blocks
    assert max(len(c) for c in chunks) * LLAMA_8B.block_bytes <= ring.rows[0].numel()
    slots = [ring.take() for _ in chunks]
    assert slots[:4] == [0, 1, 0, 1]
    # a block larger than a slot still gets a slot of exactly one block
    assert StagingRing(placement, 1 << 20).slot_blocks == 1


class MemmoveRuntime:
    """The runtime's cudaMemcpyAsync signature over host memory: moves bytes at once."""

    def __init__(self) -> None:
        self.calls = 0

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        assert kind == MEMCPY_DEFAULT and stream == 7
        ctypes.memmove(dst, src, count)
        self.calls += 1
        return 0


def test_runtime_copies_move_each_run_its_way_and_never_outside_either_buffer():
    lib, stream = MemmoveRuntime(), SimpleNamespace(cuda_stream=7)
    device = torch.arange(64, dtype=torch.uint8)
    host = torch.zeros(32, dtype=torch.uint8)
    runs = Runs(device=[8, 40], host=[0, 16], nbytes=[8, 16])
    copy_runs(lib, stream, host, device, runs, to_host=True)
    assert host[:8].tolist() == list(range(8, 16)) and host[16:].tolist() == list(range(40, 56))
    assert not host[8:16].any()
    back = torch.zeros(64, dtype=torch.uint8)
    copy_runs(lib, stream, host, back, runs, to_host=False)
    assert torch.equal(back[8:16], device[8:16]) and torch.equal(back[40:56], device[40:56])
    assert lib.calls == 4
    for bad in (Runs(device=[0], host=[24], nbytes=[16]), Runs(device=[56], host=[0], nbytes=[16])):
        with pytest.raises(IndexError):
            copy_runs(lib, stream, host, device, bad, to_host=True)
    assert lib.calls == 4


class BatchRuntime(MemmoveRuntime):
    """A runtime with ``cudaMemcpyBatchAsync`` in the signature of its ``version`` (12.8 has
    a ``failIdx`` before the stream, 13.0 not); ``refuse`` answers every batch with an error."""

    def __init__(self, version: int, refuse: bool = False) -> None:
        super().__init__()
        self.version, self.refuse, self.batches = version, refuse, 0

    def cudaRuntimeGetVersion(self, out) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0

    def cudaGetLastError(self) -> int:
        return 0

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, *rest):
        assert len(rest) == (2 if self.version < 13000 else 1) and rest[-1] == 7
        assert list(idxs) == [0] and num_attrs == 1
        assert attrs._obj.srcAccessOrder == SRC_ACCESS_ORDER_STREAM
        if self.refuse:
            return 801
        for i in range(count):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        self.batches += 1
        return 0


@pytest.mark.parametrize("version", [12080, 13000])
def test_a_transfer_goes_to_the_runtime_as_one_batch_in_either_signature(version):
    lib, stream = BatchRuntime(version), SimpleNamespace(cuda_stream=7)
    device = torch.arange(64, dtype=torch.uint8)
    host = torch.zeros(32, dtype=torch.uint8)
    runs = Runs(device=[8, 40], host=[0, 16], nbytes=[8, 16])
    copy_runs(lib, stream, host, device, runs, to_host=True)
    assert host[:8].tolist() == list(range(8, 16)) and host[16:].tolist() == list(range(40, 56))
    back = torch.zeros(64, dtype=torch.uint8)
    copy_runs(lib, stream, host, back, runs, to_host=False)
    assert torch.equal(back[8:16], device[8:16]) and torch.equal(back[40:56], device[40:56])
    assert (lib.batches, lib.calls) == (2, 0)
    with pytest.raises(IndexError):
        beyond = Runs(device=[*runs.device, 56], host=[*runs.host, 0], nbytes=[*runs.nbytes, 16])
        copy_runs(lib, stream, host, device, beyond, True)
    assert lib.batches == 2


def test_a_runtime_that_refuses_a_batch_gets_one_copy_per_run_from_then_on():
    lib, stream = BatchRuntime(13000, refuse=True), SimpleNamespace(cuda_stream=7)
    device = torch.arange(64, dtype=torch.uint8)
    host = torch.zeros(32, dtype=torch.uint8)
    runs = Runs(device=[8, 40], host=[0, 16], nbytes=[8, 16])
    for _ in range(2):
        copy_runs(lib, stream, host, device, runs, to_host=True)
    assert host[:8].tolist() == list(range(8, 16)) and host[16:].tolist() == list(range(40, 56))
    assert (lib.batches, lib.calls) == (0, 4)
