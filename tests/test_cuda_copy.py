"""The copy path's stream rules on a real GPU (skipped without one).

Run them as they are: CUDA_LAUNCH_BLOCKING off (each test checks), a busy compute stream, and
the caching allocator emptied between steps so that any memory freed under a side stream is
handed to the next compute-stream tensor at once.
"""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.vllm.layout import kv_placement
from kvtier.service.arena import SHM_DIR
from kvtier.tiers.gpu import cuda_copy
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.pinned import register_host, unregister_host
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.layout import KVLayout

from daemonutil import Daemon, daemon_name

pytestmark = pytest.mark.cuda

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)
ORDERS = ["BLHNC", "LBHNC", "LBNHC"]


@pytest.fixture(autouse=True)
def _async_launches():
    assert os.environ.get("CUDA_LAUNCH_BLOCKING", "0") in ("", "0"), "these tests need async launch"


def busy(ms: float = 200.0) -> None:
    """Queues about ``ms`` of work on the current (compute) stream."""
    torch.cuda._sleep(int(ms * 1e6))  # ~1 GHz: cycles, not a timed assertion


def filled(order: str, blocks: int = 64, seed: int = 0) -> KVPlacement:
    placement = KVPlacement.allocate(LAYOUT, blocks, "cuda", order)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    placement.buffer.copy_(
        torch.randint(
            0, 256, placement.buffer.shape, dtype=torch.uint8, device="cuda", generator=gen
        )
    )
    return placement


def blocks_of(placement: KVPlacement, ids: list[int]) -> torch.Tensor:
    out = torch.empty((len(ids), LAYOUT.block_bytes), dtype=torch.uint8, device="cuda")
    placement.gather(torch.tensor(ids, device="cuda"), out)
    return out.cpu()


def churn() -> None:
    """Hands freed memory to new compute-stream tensors at once, and scribbles on it."""
    torch.cuda.empty_cache()
    for size in (8, 64, 4096, 1 << 20):
        torch.full((size,), -1, dtype=torch.long, device="cuda")


@pytest.mark.parametrize("via", ["runtime", "torch"])
@pytest.mark.parametrize("order", ORDERS)
def test_round_trip_exact_with_busy_compute_and_reused_memory(order, via, monkeypatch):
    """Stores read, and loads write, exactly the blocks named, though the compute stream is
    busy and every tensor freed on the way is reused at once; through the
    runtime library's cudaMemcpyAsync, and through torch where that library is not found."""
    if via == "torch":
        monkeypatch.setattr(cuda_copy, "runtime", lambda: None)
    src = filled(order)
    host = HostTier(LAYOUT.block_bytes, 64 * LAYOUT.block_bytes)
    engine = CopyEngine(src, host.slab, staging_bytes=4 * LAYOUT.block_bytes)
    assert engine.host_pinned and host.slab.is_pinned()
    ids = [37, 2, 3, 4, 60, 11, 12, 50, 1, 0]
    slots = [5, 6, 7, 8, 0, 63, 1, 2, 30, 31]
    busy()
    stored = engine.store(ids, slots)
    churn()
    busy()
    stored.wait()
    engine.poll()
    want = blocks_of(src, ids)
    assert torch.equal(host.slab[slots], want)

    dst = filled(order, seed=1)
    loader = CopyEngine(dst, host.slab, staging_bytes=4 * LAYOUT.block_bytes)
    targets = [9, 10, 11, 12, 13, 40, 41, 20, 63, 0]
    untouched = blocks_of(dst, [1, 2, 62])
    busy()
    loaded = loader.load(slots, targets)
    churn()
    loaded.order_before()
    got = blocks_of(dst, targets)
    assert torch.equal(got, want)
    assert torch.equal(blocks_of(dst, [1, 2, 62]), untouched)
    engine.close()
    loader.close()


@pytest.mark.parametrize("order", ORDERS)
def test_the_engine_thread_never_waits_for_the_gpu(order):
    """Defect 2: building ids with torch.tensor(list, device=cuda) synced every step."""
    src = filled(order)
    host = HostTier(LAYOUT.block_bytes, 32 * LAYOUT.block_bytes)
    engine = CopyEngine(src, host.slab, staging_bytes=4 * LAYOUT.block_bytes)
    compute = torch.cuda.current_stream()
    busy(2000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        store = engine.store([5, 9, 10, 11, 30], [0, 1, 2, 3, 4])
        load = engine.load([0, 1, 2], [40, 41, 50])
        engine.poll()
        load.order_before()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not compute.query(), "a kvtier call waited for the compute stream"
    assert not store.done() and not load.done()  # they wait for it too, on the GPU
    engine.synchronize()


def test_a_finished_load_completes_while_a_store_waits():
    """Defect 5: one FIFO across both streams held finished loads behind stores."""
    src = filled("BLHNC")
    host = HostTier(LAYOUT.block_bytes, 32 * LAYOUT.block_bytes)
    engine = CopyEngine(src, host.slab)
    order: list[str] = []
    busy(3000)  # the store waits for this
    engine.store(list(range(16)), list(range(16)), callback=lambda: order.append("store"))
    with torch.cuda.stream(torch.cuda.Stream()):  # a compute stream with nothing queued
        load = engine.load([20], [40], callback=lambda: order.append("load"))
        load.wait()
    engine.poll()
    assert order == ["load"]
    engine.synchronize()
    assert order == ["load", "store"]


@pytest.mark.parametrize("order", ORDERS)
def test_writes_ordered_after_a_handed_off_store_never_reach_its_copy(order):
    """A store's copies are queued on the engine's own thread, after the call returns; the
    writes the engine orders after it (a recycled block's next writer) wait for them."""
    src = filled(order)
    host = HostTier(LAYOUT.block_bytes, 32 * LAYOUT.block_bytes)
    engine = CopyEngine(src, host.slab, staging_bytes=4 * LAYOUT.block_bytes)
    ids, slots = [3, 7, 8, 20, 41], [4, 0, 1, 2, 3]
    want = blocks_of(src, ids)
    busy()
    store = engine.store(ids, slots)
    store.order_before()
    src.buffer.fill_(0)
    store.wait()
    assert torch.equal(host.slab[slots], want)
    engine.close()


@pytest.mark.parametrize("order", ORDERS)
def test_gpu_memory_stays_within_the_ring(order):
    """Defect 3: each transfer allocated n x block_bytes of staging outside vLLM's budget."""
    src = filled(order, blocks=256)
    host = HostTier(LAYOUT.block_bytes, 256 * LAYOUT.block_bytes)
    ring = 8 * LAYOUT.block_bytes
    engine = CopyEngine(src, host.slab, staging_bytes=ring)
    if order == "BLHNC":
        assert engine.staging_bytes == 0  # one DMA per run, straight from the KV buffer
    else:
        assert 0 < engine.staging_bytes <= ring + 2 * 256 * 8  # the ring, an id per block each way
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ids = list(range(0, 256, 2)) + list(range(1, 256, 2))
    engine.store(ids, list(range(256)))
    engine.load(list(range(256)), ids)
    engine.synchronize()
    assert torch.cuda.max_memory_allocated() - before == 0


def test_slab_is_page_locked_on_the_engine_thread_under_its_device():
    """The client's background thread registered the arena (a context on GPU 0).

    The arena lies on tmpfs as the daemon's does: Linux refuses to lock a writable shared
    mapping of a disk file (recent kernels answer "invalid argument")."""
    path = SHM_DIR / f"kvtier-{daemon_name()}"
    script = textwrap.dedent(
        f"""
        import threading, torch
        from kvtier.connector.client.arena import ArenaView
        from kvtier.tiers.gpu.copy_engine import CopyEngine
        from kvtier.tiers.gpu.placement import KVPlacement
        from kvtier.tiers.layout import KVLayout
        layout = KVLayout(2, 2, 64, 16, torch.float16)
        path = {str(path)!r}
        open(path, "wb").write(bytes(8 * layout.block_bytes))
        arena = ArenaView(layout.block_bytes)
        t = threading.Thread(target=arena.map, args=(path, 8 * layout.block_bytes, 8))
        t.start(); t.join()
        assert not torch.cuda.is_initialized(), "mapping touched CUDA"
        device = torch.device("cuda", torch.cuda.device_count() - 1)
        engine = CopyEngine(KVPlacement.allocate(layout, 4, device), arena.slab)
        assert engine.host_pinned and arena.slab.is_pinned()
        engine.close()
        assert not arena.slab.is_pinned()
        print("ok")
        """
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    finally:
        path.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_slab_that_cannot_be_locked_is_reported_and_clears_its_error(tmp_path, caplog):
    """Defect 4: an unchecked cudaHostRegister left copies silently synchronous."""
    path = tmp_path / "readonly"
    path.write_bytes(bytes(4 * LAYOUT.block_bytes))
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    slab = torch.frombuffer(mapping, dtype=torch.uint8).view(4, LAYOUT.block_bytes)
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.gpu.pinned"):
        engine = CopyEngine(filled("BLHNC"), slab)
    assert not engine.host_pinned
    assert any("pageable" in r.message for r in caplog.records)
    torch.ones(16, device="cuda").mul_(2)  # the failed call left no error for this launch
    torch.cuda.synchronize()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.gpu.pinned"):
        for _ in range(3):  # loads read the slab, so a read-only mapping serves them
            engine.load([0, 1], [2, 3]).wait()
    assert not caplog.records  # the mapping that could not be locked is not tried per copy
    engine.close()


def test_round_trip_through_the_daemon_arena_with_vllm_shaped_tensors():
    """GPU -> the daemon's shared arena -> GPU, as the vLLM worker does it, across a daemon
    restart: the client re-maps the new arena on its own thread, and the same copy engines
    unlock the old mapping and lock the new one on this (the engine's) thread."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
    daemon = Daemon(host_bytes=64 * LAYOUT.block_bytes, disk_bytes=256 * LAYOUT.block_bytes)
    daemon.start()
    client = DaemonClient(
        LAYOUT.signature, LAYOUT.block_bytes, block_tokens=LAYOUT.block_size, target=daemon.target
    )
    src, dst = filled("BLHNC"), filled("LBHNC", seed=9)
    stores = CopyEngine(
        kv_placement(LAYOUT, dict(zip(names, src.layer_views(), strict=True)), names), client.slab
    )
    loads = CopyEngine(
        kv_placement(LAYOUT, dict(zip(names, dst.layer_views(), strict=True)), names), client.slab
    )
    try:
        for round_ in range(2):
            assert client.wait_connected(60), daemon.log.read_text()
            src.buffer.copy_(filled("BLHNC", seed=round_ + 1).buffer)
            hashes = [bytes([round_, i]) * 8 for i in range(6)]
            slots = client.reserve(hashes)
            busy()
            stores.store([7, 8, 9, 33, 34, 2], slots).wait()
            assert stores.host_pinned and client.slab.is_pinned()
            assert client.commit(slots)
            acquired = client.acquire(hashes)
            loads.load(acquired, [0, 1, 2, 3, 4, 5]).order_before()
            assert torch.equal(blocks_of(dst, list(range(6))), blocks_of(src, [7, 8, 9, 33, 34, 2]))
            loads.poll()
            client.release(acquired)
            client.settle()
            if round_ == 0:
                assert daemon.stop() == 0
                daemon.proc = None
                daemon.start()
                deadline = time.monotonic() + 60
                while client.sessions_opened < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)  # the client notices the restart on its own thread
    finally:
        stores.close()
        loads.close()
        client.close()
        daemon.cleanup()


def test_a_restarted_daemons_arena_is_page_locked_on_the_clients_thread():
    """As the vLLM worker sets it up: the client page-locks each arena it maps, under the
    engine's device, on its own thread and before the session that uses it is published; the
    copy engines lock nothing, and copy through the new arena page-locked from its first
    transfer."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
    daemon = Daemon(host_bytes=64 * LAYOUT.block_bytes, disk_bytes=256 * LAYOUT.block_bytes)
    daemon.start()
    client = DaemonClient(
        LAYOUT.signature, LAYOUT.block_bytes, block_tokens=LAYOUT.block_size, target=daemon.target
    )
    device = torch.device("cuda", torch.cuda.current_device())
    seen: list[tuple[str, str]] = []

    def lock(slab: torch.Tensor) -> bool:
        seen.append(("lock", threading.current_thread().name))
        return register_host(slab, device, LAYOUT.block_bytes)

    def unlock(slab: torch.Tensor) -> None:
        seen.append(("unlock", threading.current_thread().name))
        unregister_host(slab.data_ptr(), device)

    src, dst = filled("BLHNC"), filled("LBHNC", seed=9)
    assert client.wait_connected(60), daemon.log.read_text()
    client.page_lock_with(lock, unlock)
    stores = CopyEngine(
        kv_placement(LAYOUT, dict(zip(names, src.layer_views(), strict=True)), names),
        client.slab,
        lock_host=False,
    )
    loads = CopyEngine(
        kv_placement(LAYOUT, dict(zip(names, dst.layer_views(), strict=True)), names),
        client.slab,
        lock_host=False,
    )
    try:
        for round_ in range(2):
            deadline = time.monotonic() + 60
            while not (client.sessions_opened > round_ and client.connected):
                assert time.monotonic() < deadline, daemon.log.read_text()
                time.sleep(0.05)  # the client notices the restart on its own thread
            assert client.slab.is_pinned()  # before any transfer of this session
            src.buffer.copy_(filled("BLHNC", seed=round_ + 1).buffer)
            hashes = [bytes([round_, i]) * 8 for i in range(6)]
            slots = client.reserve(hashes)
            busy()
            stores.store([7, 8, 9, 33, 34, 2], slots).wait()
            assert stores.host_pinned
            assert client.commit(slots)
            acquired = client.acquire(hashes)
            loads.load(acquired, [0, 1, 2, 3, 4, 5]).order_before()
            assert torch.equal(blocks_of(dst, list(range(6))), blocks_of(src, [7, 8, 9, 33, 34, 2]))
            loads.poll()
            client.release(acquired)
            client.settle()
            if round_ == 0:
                assert daemon.stop() == 0
                daemon.proc = None
                daemon.start()
        main = threading.current_thread().name
        assert seen == [("lock", main), ("unlock", "kvtier-client"), ("lock", "kvtier-client")]
    finally:
        stores.close()
        loads.close()
        client.close()
        daemon.cleanup()
