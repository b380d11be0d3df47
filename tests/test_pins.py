"""Pins on a real host tier, on a clock the test turns: never evicted before they lapse, freed
to the LRU after, within each session's budget; a block pinned before its commit is pinned at
the commit, or counted missed if it never comes."""

from __future__ import annotations

import argparse
import uuid

import numpy as np
import pytest

from kvtier.service import config, flags
from kvtier.service.pins import LayoutPins
from kvtier.service.tunables import TUNABLES
from kvtier.tiers.host.tier import HostTier

BLOCK = 4096
SLOTS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hashes(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes for _ in range(n)]


def store(host: HostTier, blocks: list[bytes]) -> None:
    slots = host.reserve(blocks)
    assert all(slot >= 0 for slot in slots), slots
    for slot in slots:
        host.slot_array(slot)[:] = np.uint8(7)
    host.commit(slots)


def flood(host: HostTier, n: int) -> None:
    """Stores ``n`` unrelated blocks one at a time, so the LRU evicts what it may."""
    for block in hashes(n):
        store(host, [block])


def setup(budget: int = 4) -> tuple[HostTier, LayoutPins, Clock]:
    host = HostTier(BLOCK, SLOTS * BLOCK)
    clock = Clock()
    return host, LayoutPins(host, budget, clock), clock


def test_a_pin_keeps_its_blocks_until_it_lapses_then_frees_them_to_the_lru() -> None:
    host, pins, clock = setup()
    kept, other = hashes(3), hashes(3)
    store(host, kept + other)
    assert pins.pin("a", kept, 10.0) == (3, 0)
    assert pins.pinned_blocks == 3
    flood(host, 4 * SLOTS)
    assert all(host.contains(h) for h in kept)
    assert not any(host.contains(h) for h in other)
    clock.now += 9.9
    assert pins.sweep() == 0
    clock.now += 0.2
    assert pins.sweep() == 3
    assert pins.pinned_blocks == 0 and pins.held_by("a") == 0
    flood(host, 4 * SLOTS)
    assert not any(host.contains(h) for h in kept)


def test_pinning_again_extends_and_two_sessions_hold_a_block_until_both_lapse() -> None:
    host, pins, clock = setup()
    block = hashes(1)
    store(host, block)
    assert pins.pin("a", block, 10.0) == (1, 0)
    assert pins.pin("a", block, 30.0) == (1, 0)  # extends, one pin still
    assert pins.pin("b", block, 20.0) == (1, 0)
    assert (pins.held_by("a"), pins.held_by("b"), pins.pinned_blocks) == (1, 1, 1)
    clock.now += 25.0
    assert pins.sweep() == 0  # a's pin lasts 30 s: the first deadline was extended
    assert (pins.held_by("a"), pins.held_by("b")) == (1, 0)
    flood(host, 4 * SLOTS)
    assert host.contains(block[0])
    clock.now += 5.0
    assert pins.sweep() == 1
    flood(host, 4 * SLOTS)
    assert not host.contains(block[0])


def test_pins_beyond_the_budget_are_refused_and_counted() -> None:
    host, pins, _ = setup(budget=4)
    blocks = hashes(6)
    store(host, blocks)
    assert pins.pin("a", blocks, 10.0) == (4, 2)
    assert pins.pin("a", blocks[:4], 10.0) == (4, 0)  # pinned already: no new pin
    assert pins.refused == 2 and pins.pinned_blocks == 4
    assert pins.pin("b", blocks[3:], 10.0) == (3, 0)  # b has a budget of its own
    assert (pins.held_by("a"), pins.held_by("b"), pins.pinned_blocks) == (4, 3, 6)


def test_a_block_pinned_before_its_commit_is_pinned_at_the_commit() -> None:
    host, pins, _ = setup()
    block = hashes(1)
    (slot,) = host.reserve(block)
    assert pins.pin("a", block, 10.0) == (1, 0)
    assert pins.pinned_blocks == 0
    host.commit([slot])
    pins.committed()
    assert pins.pinned_blocks == 1
    flood(host, 4 * SLOTS)
    assert host.contains(block[0])


def test_a_pin_of_a_block_that_never_comes_is_missed_and_gives_its_budget_back() -> None:
    host, pins, clock = setup(budget=2)
    assert pins.pin("a", hashes(2), 60.0) == (2, 0)
    clock.now += TUNABLES.pin_pending_s
    pins.sweep()
    assert (pins.missed, pins.pinned_blocks, pins.held_by("a")) == (2, 0, 0)
    block = hashes(1)
    store(host, block)
    assert pins.pin("a", block, 60.0) == (1, 0)
    assert pins.pinned_blocks == 1


def test_pin_share_is_a_setting_checked_at_start() -> None:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    assert flags.from_args(parser.parse_args(["--pin-share", "0.5"])).pin_share == 0.5
    assert config.DaemonConfig().pin_share == 0.25
    for bad in (0.0, 1.5):
        with pytest.raises(config.ConfigError, match="pin_share"):
            config.DaemonConfig(pin_share=bad)
