from __future__ import annotations

from kvtier.tiers.host.tier import HostTier
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
