"""Admission policies: which offered blocks enter the host tier and which reach the disk, the
ghost list's bound, and the in-process stack honouring both."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.host.admission import (
    DEFAULT_POLICY,
    MIN_GHOST,
    POLICIES,
    AdmitAll,
    GhostList,
    HitToDisk,
    SecondHit,
    admission_policy,
)
from kvtier.tiers.host.tier import HostTier
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.lower import NOT_ADMITTED
from kvtier.tiers.stack import build_local_stack

from tierutil import run_request

BLOCK = 64


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def offer(host: HostTier, i: int) -> bool:
    """Offers block ``i`` as an engine does; True if the host tier took it."""
    (slot,) = host.reserve([h(i)])
    if slot == NOT_ADMITTED:
        return False
    assert slot >= 0, f"reserve answered {slot}"
    host.slot_array(slot)[:] = i % 251
    host.commit([slot])
    return True


def hit(host: HostTier, i: int) -> None:
    slots = host.acquire([h(i)])
    assert len(slots) == 1, f"block {i} is not in the host tier"
    host.release(slots)


# ---- the ghost list ----


def test_ghost_list_never_holds_more_than_its_capacity_and_forgets_the_oldest_first():
    ghost = GhostList(3)
    for i in range(5):
        ghost.offered(h(i))
        assert len(ghost) <= 3
    assert [h(i) in ghost for i in range(5)] == [False, False, True, True, True]
    ghost.offered(h(2))  # seen again: now the most recent
    ghost.looked_up(h(5))
    assert len(ghost) == 3
    assert h(3) not in ghost and h(2) in ghost and h(5) in ghost


def test_ghost_list_counts_a_lookup_miss_and_its_offer_as_one_sighting():
    ghost = GhostList(8)
    assert ghost.looked_up(h(1)) == 1
    assert ghost.looked_up(h(1)) == 1  # asked again before the offer: the same sighting
    assert ghost.offered(h(1)) == 1  # the offer the miss was waiting for
    assert ghost.offered(h(1)) == 2  # an offer with no miss before it is a new sighting
    assert ghost.looked_up(h(1)) == 3
    with pytest.raises(ValueError):
        GhostList(0)


def test_a_forgotten_first_sighting_makes_the_next_offer_a_first_one_again():
    policy = SecondHit(ghost_capacity=2)
    assert not policy.admit(h(1))
    assert not policy.admit(h(2))
    assert not policy.admit(h(3))  # the list holds two hashes: h(1) is forgotten
    assert len(policy.ghost) == 2
    assert not policy.admit(h(1))
    assert policy.admit(h(1))


# ---- decisions ----


def test_second_hit_admits_on_the_second_sighting_and_not_the_first():
    host = HostTier(BLOCK, BLOCK * 8, admission=SecondHit())
    assert not offer(host, 1)
    assert host.lookup([h(1)]).total == 0
    assert host.counters.blocks_not_admitted == 1
    assert offer(host, 2) is False
    assert offer(host, 1)  # second offer of block 1
    assert host.lookup([h(1)]).host == 1
    # An engine's lookup miss, then its offer of the block it computed: one sighting.
    assert host.lookup([h(3)]).total == 0
    assert not offer(host, 3)
    assert host.lookup([h(3)]).total == 0  # a second request wants it
    assert offer(host, 3)
    assert host.counters.blocks_not_admitted == 3


def test_all_admits_every_block_at_once():
    host = HostTier(BLOCK, BLOCK * 8)
    assert isinstance(host.admission, AdmitAll)
    assert offer(host, 1)
    assert host.counters.blocks_not_admitted == 0


def test_a_block_evicted_from_the_host_tier_comes_back_on_its_next_offer():
    host = HostTier(BLOCK, BLOCK * 2, admission=SecondHit())
    for i in (1, 2, 3):
        assert not offer(host, i)
        assert offer(host, i)  # block 3 evicts block 1
    assert host.lookup([h(1)]).total == 0
    assert offer(host, 1)  # it was wanted twice already


@pytest.mark.parametrize("policy", [AdmitAll, HitToDisk])
def test_hit_to_disk_writes_only_blocks_hit_in_the_host_tier(tmp_path, policy):
    every = policy is AdmitAll
    with DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100, sync=False) as disk:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk, admission=policy())
        assert offer(host, 1) and offer(host, 2)
        hit(host, 1)  # block 2 is now the least recently used
        assert offer(host, 3) and offer(host, 4)  # evict 2 (never hit), then 1 (hit)
        disk.flush()
        assert disk.counters.blocks_stored == (2 if every else 1)
        assert disk.contains(h(1))
        assert disk.contains(h(2)) == every
        assert host.counters.blocks_spilled == (2 if every else 1)
        assert host.counters.blocks_kept_off_disk == (0 if every else 1)
        # At shutdown, too, only what was hit goes down.
        hit(host, 4)
        assert host.spill_all() == (2 if every else 1)
        disk.flush()
        assert disk.contains(h(4)) and disk.contains(h(3)) == every


def test_hit_to_disk_writes_behind_at_the_first_hit(tmp_path):
    with DiskTier(tmp_path, b"s" * 16, BLOCK, BLOCK * 100, sync=False) as disk:
        host = HostTier(BLOCK, BLOCK * 2, lower=disk, write_behind=True, admission=HitToDisk())
        assert offer(host, 1) and offer(host, 2)
        disk.flush()
        assert host.writing_behind == 0
        assert disk.counters.blocks_stored == 0  # committed, readable, not written down
        hit(host, 1)
        hit(host, 1)  # the second hit starts no second write
        disk.flush()
        assert host.writing_behind == 0
        assert disk.counters.blocks_stored == 1 and disk.contains(h(1))
        assert offer(host, 3) and offer(host, 4)  # evicts both: only block 1 is on disk
        disk.flush()
        assert disk.counters.blocks_stored == 1 and not disk.contains(h(2))
        assert host.counters.blocks_kept_off_disk == 1
        assert host.lookup([h(1), h(2)]).disk == 1


def test_policies_by_name():
    assert POLICIES[:3] == ("all", "second-hit", "hit-to-disk")
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        assert admission_policy(name, 10).name == name
    assert admission_policy("second-hit", 10).ghost.capacity == MIN_GHOST
    assert admission_policy("second-hit", MIN_GHOST).ghost.capacity == 4 * MIN_GHOST
    with pytest.raises(ValueError, match="second-hit"):
        admission_policy("lru", 10)


# ---- the in-process stack ----


def test_the_stack_offers_a_turned_away_block_once_and_admits_it_on_its_second_life():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, block_size=4, dtype=torch.uint8)
    # Four GPU blocks: each prompt of three evicts the one before it.
    stack = build_local_stack(layout, 4, host_bytes=16 * layout.block_bytes, admission="second-hit")
    try:
        a, b, c = ([h(100 * k + i) for i in range(3)] for k in (1, 2, 3))
        for prompt in (a, b, c):
            assert run_request(stack, prompt) == (0, 0, 0)
        host = stack.lower.counters
        assert host.blocks_stored == 0
        assert host.blocks_not_admitted == 9  # each block offered once as it was freed
        # a's second life: its eviction is its second sighting.
        for prompt in (a, b, c):
            assert run_request(stack, prompt) == (0, 0, 0)
        assert run_request(stack, a) == (0, 3, 0)
    finally:
        stack.close()
