"""The tier core's CUDA paths: stream-ordered copies, pinned slabs, spills and loads on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.pinned import is_registered
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.hashing import Namespace, hash_prompt
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.stack import build_local_stack

pytestmark = pytest.mark.cuda

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)


def test_host_slab_is_exact_and_locked_by_the_engine():
    """Defect 6: pin_memory=True went through the caching host allocator (power-of-two)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.5
    torch.cuda.init()
    before = stats() if stats else {}
    host = HostTier(LAYOUT.block_bytes, 5 * LAYOUT.block_bytes)
    if stats:
        key = "allocated_bytes.current"  # what PyTorch's caching host allocator holds
        assert stats().get(key, 0) == before.get(key, 0)
    assert host.slab.numel() == 5 * LAYOUT.block_bytes and not host.slab.is_pinned()
    engine = CopyEngine(KVPlacement.allocate(LAYOUT, 4, "cuda"), host.slab)
    assert engine.host_pinned and host.slab.is_pinned() and is_registered(host.slab)
    engine.close()
    assert not is_registered(host.slab)


def test_store_waits_for_compute_stream_and_load_hands_back_an_event():
    placement = KVPlacement.allocate(LAYOUT, 8, "cuda")
    kv = placement.layer_views()
    host = HostTier(LAYOUT.block_bytes, 8 * LAYOUT.block_bytes)
    engine = CopyEngine(placement, host.slab)
    slots = host.reserve([bytes([i]) * 16 for i in range(4)])
    # A long kernel queue on the compute stream writes the KV; the store must see its result.
    for _ in range(50):
        for t in kv:
            t.mul_(0).add_(3.0)
    done = engine.store([0, 1, 2, 3], slots, callback=lambda: host.commit(slots))
    done.wait()
    engine.poll()
    want = torch.empty((4, LAYOUT.block_bytes), dtype=torch.uint8, device="cuda")
    placement.gather(torch.arange(4, device="cuda"), want)
    assert torch.equal(host.slab[slots].cuda(), want)

    acquired = host.acquire([bytes([i]) * 16 for i in range(4)])
    load = engine.load(acquired, [4, 5, 6, 7], callback=lambda: host.release(acquired))
    load.order_before()
    for t in kv:
        assert torch.equal(t[4:8], t[0:4])
    engine.close()


def test_spill_and_walk_back_on_gpu(tmp_path):
    ns = Namespace("cuda", LAYOUT.signature)
    stack = build_local_stack(
        LAYOUT,
        4,
        host_bytes=16 * LAYOUT.block_bytes,
        disk_path=tmp_path,
        disk_bytes=64 * LAYOUT.block_bytes,
        device="cuda",
    )
    try:
        requests = [hash_prompt(ns, list(range(i * 100, i * 100 + 64)), 16) for i in range(4)]
        expected = {}
        for hashes in requests:
            blocks = stack.pool.get_new_blocks(len(hashes))
            for transfer in stack.pool.pending_reads(blocks):
                transfer.order_before()
            for b, h in zip(blocks, hashes, strict=True):
                for t in stack.placement.layer_views():
                    t[b.block_id].fill_(float(int.from_bytes(h[:2], "little") % 97))
                expected[h] = float(int.from_bytes(h[:2], "little") % 97)
            stack.pool.cache_full_blocks(blocks, hashes)
            stack.pool.free_blocks(reversed(blocks))
        match = stack.cache.match(requests[0], 65)
        assert match.lower.total == 4
        claimed = stack.cache.claim(match)
        claimed.transfer.order_before()
        for b, h in zip(claimed.blocks, requests[0], strict=True):
            assert bool((stack.placement.layer_views()[0][b.block_id] == expected[h]).all())
    finally:
        stack.close()
