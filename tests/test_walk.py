from __future__ import annotations

import numpy as np
import torch

from kvtier.tiers.copy_engine import CopyEngine, copy_rows
from kvtier.tiers.host import HostTier
from kvtier.tiers.stack import build_stack

from tierutil import run_request


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [(salt << 32 | i).to_bytes(16, "little") for i in range(n)]


def test_match_is_side_effect_free_and_truncates(small_layout):
    host = HostTier(small_layout.block_bytes, 8 * small_layout.block_bytes)
    stack = build_stack(small_layout, 4, lower=host)
    hs = hashes(6)
    run_request(stack, hs[:4])
    run_request(stack, hashes(4, salt=1))  # pushes the first request's blocks to the host
    before = (host.counters.as_dict(), stack.pool.num_free)
    match = stack.cache.match(hs, 6 * 4 + 1)
    assert (len(match.gpu_blocks), match.lower.host, match.lower.disk) == (0, 4, 0)
    assert stack.cache.match(hs, 6 * 4 + 1).num_blocks == 4
    assert (host.counters.as_dict(), stack.pool.num_free) == before
    cut = match.truncate(3)
    assert (cut.num_blocks, cut.lower.host, len(cut.hashes)) == (3, 3, 3)
    claimed = stack.cache.claim(cut)
    assert (claimed.gpu_hits, claimed.host_hits, len(claimed.blocks)) == (0, 3, 3)
    assert stack.cache.counters.host.hit_tokens == 3 * 4


def test_claim_without_room_takes_only_gpu_hits(small_layout):
    host = HostTier(small_layout.block_bytes, 8 * small_layout.block_bytes)
    stack = build_stack(small_layout, 4, lower=host)
    run_request(stack, hashes(4))
    run_request(stack, hashes(4, salt=1))
    held = stack.pool.get_new_blocks(2)  # only two free blocks remain for four host hits
    claimed = stack.cache.claim(stack.cache.match(hashes(4), 17))
    assert claimed.blocks == [] and claimed.host_hits == 0
    stack.pool.free_blocks(held)


def test_copy_rows_and_cpu_copy_engine_roundtrip(small_layout):
    kv = small_layout.allocate(4)
    for t in kv:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    slab = torch.zeros((3, small_layout.block_bytes), dtype=torch.uint8)
    engine = CopyEngine(small_layout, kv, slab)
    done = []
    transfer = engine.store([3, 1], [2, 0], callback=lambda: done.append("stored"))
    assert transfer.done() and done == ["stored"]
    engine.load([2, 0], [0, 2], callback=lambda: done.append("loaded"))
    assert done == ["stored", "loaded"]
    for t in kv:
        assert torch.equal(t[:, 0], t[:, 3]) and torch.equal(t[:, 2], t[:, 1])
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
