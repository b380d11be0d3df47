"""The host tier's slot table: its batch forms leave exactly what the single forms leave."""

from __future__ import annotations

import random

import pytest

from kvtier.tiers.hashing import check_hashes
from kvtier.tiers.host.slots import SlotTable

SLOTS = 64


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lru_order(table: SlotTable) -> list[int]:
    """The LRU, least recently used first, read by popping a copy's links."""
    order = []
    while (slot := table.lru_pop()) is not None:
        order.append(slot)
    return order


def state_of(table: SlotTable) -> tuple:
    return (
        list(table.refs),
        table.lru_len,
        [table._last_use[s] for s in range(SLOTS)],
        lru_order(table),
    )


@pytest.mark.parametrize("seed", range(20))
def test_batch_touch_pin_unpin_match_the_single_forms(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    single, batch = SlotTable(SLOTS, clock=clock), SlotTable(SLOTS, clock=clock)
    for slot in rng.sample(range(SLOTS), SLOTS):
        single.lru_push(slot)
        batch.lru_push(slot)
    pinned: list[int] = []
    for _ in range(200):
        clock.now += 1.0
        op = rng.choice(("touch", "pin", "unpin"))
        if op == "unpin":
            slots = rng.sample(pinned, min(len(pinned), rng.randint(0, 8)))
            for slot in slots:
                pinned.remove(slot)
        else:
            # a lookup names a slot once; a pin may land on a slot pinned already
            slots = rng.sample(range(SLOTS), rng.randint(0, 12))
        if op == "pin":
            pinned += slots
        for slot in slots:
            getattr(single, op)(slot)
        getattr(batch, f"{op}_all")(slots)
    assert state_of(single) == state_of(batch)


def test_check_hashes_refuses_what_check_hash_refuses() -> None:
    good = [bytes(16)] * 1000
    check_hashes(good)
    check_hashes([])
    for bad in (bytes(15), bytes(17), "x" * 16, bytearray(16), None):
        with pytest.raises(ValueError, match="16 bytes"):
            check_hashes([*good, bad])
