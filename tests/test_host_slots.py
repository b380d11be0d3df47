"""The host tier's slot table: its batch forms leave exactly what the single forms leave, its
LRU log stays bounded, and its batch walk finds what a hash-by-hash walk finds."""

from __future__ import annotations

import random

import pytest

from kvtier.tiers.hashing import check_hashes
from kvtier.tiers.host.lru import COMPACT_SLACK
from kvtier.tiers.host.slots import READY, WRITING, SlotTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lru_order(table: SlotTable) -> list[int]:
    """The LRU, least recently used first, read by popping it empty."""
    order = []
    while (slot := table.lru_pop()) is not None:
        order.append(slot)
    return order


def state_of(table: SlotTable) -> tuple:
    return (
        list(table.refs),
        table.lru_len,
        [table.last_use(s) if table.refs[s] == 0 else None for s in range(table.num_slots)],
        table.oldest_age_s(),
        lru_order(table),
    )


# Short batches go slot by slot; long ones (SMALL_BATCH and more) through numpy, unless they
# name a slot twice. Many rounds on a small table also make the LRU's log compact.
@pytest.mark.parametrize(
    ("seed", "slots", "longest", "rounds"),
    [(seed, 64, 12, 200) for seed in range(10)]
    + [(seed, 2048, 700, 120) for seed in range(6)]
    + [(seed, 96, 90, 3000) for seed in range(2)],
)
def test_batch_touch_pin_unpin_match_the_single_forms(
    seed: int, slots: int, longest: int, rounds: int
) -> None:
    rng = random.Random(seed)
    clock = Clock()
    single, batch = SlotTable(slots, clock=clock), SlotTable(slots, clock=clock)
    for slot in rng.sample(range(slots), slots):
        single.lru_push(slot)
        batch.lru_push(slot)
    pinned: list[int] = []
    for _ in range(rounds):
        clock.now += 1.0
        op = rng.choice(("touch", "pin", "unpin"))
        size = rng.randint(0, longest)
        if op == "unpin":
            held = sorted(set(pinned))
            some = rng.sample(held, min(len(held), size))
            twice = [slot for slot in some if pinned.count(slot) > 1]
            if twice and rng.random() < 0.2:
                some.append(rng.choice(twice))  # a slot pinned twice, released twice
            for slot in some:
                pinned.remove(slot)
        else:
            some = rng.sample(range(slots), min(slots, size))
            if some and rng.random() < 0.2:
                some.insert(rng.randrange(len(some)), rng.choice(some))  # a slot named twice
        if op == "pin":
            pinned += some
        for slot in some:
            getattr(single, op)(slot)
        getattr(batch, f"{op}_all")(some)
        if rng.random() < 0.1:  # evictions between the batches, one by one or many at once
            count = rng.randint(0, longest)
            popped = [single.lru_pop() for _ in range(count)]
            assert batch.lru_pop_many(count) == [slot for slot in popped if slot is not None]
    assert state_of(single) == state_of(batch)


def test_the_lru_log_stays_bounded_under_touches() -> None:
    table = SlotTable(4096)
    for slot in range(4096):
        table.lru_push(slot)
    hot = list(range(1000))
    for _ in range(200):  # 200,000 touches of 1,000 slots
        table.touch_all(hot)
    assert len(table._lru._log) <= 2 * table.lru_len + COMPACT_SLACK
    assert lru_order(table) == list(range(1000, 4096)) + hot


@pytest.mark.parametrize("seed", range(8))
def test_ready_run_is_the_readable_prefix(seed: int) -> None:
    rng = random.Random(seed)
    table = SlotTable(6000)
    hashes = [i.to_bytes(16, "big") for i in range(6000)]
    for h in hashes:
        slot = table.pop_free()
        table.claim(slot, h, b"")
        table.state[slot] = READY
    end = rng.choice([0, 1, 31, 32, 33, 100, 159, 160, 161, 2000, 5999, 6000])
    if end < len(hashes):
        if rng.random() < 0.5:
            table.state[table.index[hashes[end]]] = WRITING  # reserved, not readable yet
        else:
            table.drop(table.index[hashes[end]])
    start = rng.randint(0, min(end, 40))
    want = [table.index[h] for h in hashes[start:end]]
    assert table.ready_run(hashes, start) == want
    assert table.ready_run(hashes[start:end]) == want


def test_check_hashes_refuses_what_check_hash_refuses() -> None:
    good = [bytes(16)] * 1000
    check_hashes(good)
    check_hashes([])
    for bad in (bytes(15), bytes(17), "x" * 16, bytearray(16), None):
        with pytest.raises(ValueError, match="16 bytes"):
            check_hashes([*good, bad])


@pytest.mark.parametrize("length", [3, 200])
def test_check_release_refuses_what_was_not_acquired(length: int) -> None:
    table = SlotTable(400)
    for slot in range(length):
        table.claim(table.pop_free(), slot.to_bytes(16, "big"), b"")
        table.state[slot] = READY
        table.lru_push(slot)
    pinned = list(range(length))
    table.pin_all(pinned)
    table.check_release(pinned)
    with pytest.raises(ValueError, match="more often"):
        table.check_release([*pinned, pinned[-1]])  # pinned once, released twice
    with pytest.raises(ValueError, match="not in the state"):
        table.check_release([*pinned[1:], length])  # never stored
    with pytest.raises(ValueError, match="not in the state"):
        table.check_release([*pinned[1:], 400])  # no such slot
    table.pin(pinned[0])
    table.check_release([*pinned, pinned[0]])  # pinned twice, released twice
