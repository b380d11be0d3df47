"""A lookup's host hits are held for the acquire that follows: what Lookup calls a host hit,
Acquire finds in the host tier, however busy the tier is meanwhile — and the hold ends (the
slots become evictable again) at the acquire, at its deadline, or with the session."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from daemonutil import BLOCK_BYTES, Daemon, block_hash, content, load, store, wait_until

HOST_SLOTS = 32


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=HOST_SLOTS * BLOCK_BYTES, extra=["--lookup-hold-s", "3"]).start()
    yield d
    d.cleanup()


def flood(client, tag: str, blocks: int) -> None:
    """Stores ``blocks`` unrelated blocks in batches, waiting for each batch's disk write, so
    the host tier's LRU evicts whatever it may."""
    for start in range(0, blocks, 8):
        hashes = [block_hash(tag, i) for i in range(start, start + 8)]
        assert store(client, hashes) == hashes
        wait_until(lambda: client.tools.stats().layouts[0].writing_behind == 0, "the disk writes")


def test_a_lookup_keeps_its_host_hits_for_the_acquire(daemon):
    engine, other = daemon.client(client_name="engine"), daemon.client(client_name="other")
    prefix = [block_hash("prefix", i) for i in range(8)]
    assert store(engine, prefix) == prefix
    assert engine.lookup(prefix).host == len(prefix)
    flood(other, "flood", 4 * HOST_SLOTS)  # four times the host tier, after the lookup
    slots, sources = engine.acquire_with_sources(prefix)
    assert (len(slots), sources.host, sources.disk) == (len(prefix), len(prefix), 0)
    engine.release(slots)
    assert engine.settle(timeout=30)
    # The acquire ended the hold: the same flood now pushes the prefix out to disk.
    flood(other, "again", 4 * HOST_SLOTS)
    slots, sources = engine.acquire_with_sources(prefix)
    assert sources.host == 0 and sources.disk == len(prefix)
    engine.release(slots)
    engine.close()
    other.close()


def test_a_hold_ends_at_its_deadline_and_with_the_session(daemon):
    engine, other = daemon.client(client_name="engine"), daemon.client(client_name="other")
    prefix = [block_hash("deadline", i) for i in range(8)]
    assert store(engine, prefix) == prefix
    assert engine.lookup(prefix).host == len(prefix)
    stats = daemon.stats()
    assert stats.acquired_slots == 0 and stats.layouts[0].held_slots == len(prefix)
    wait_until(lambda: daemon.stats().layouts[0].held_slots == 0, "the hold's deadline")
    assert daemon.stats().layouts[0].holds_expired == len(prefix)
    flood(other, "after-deadline", 4 * HOST_SLOTS)
    slots, sources = other.acquire_with_sources(prefix)  # an acquire holds nothing more
    assert sources.host == 0 and sources.disk == len(prefix)
    other.release(slots)
    engine.close()
    other.close()
    # A session that ends gives its holds back at once.
    third = daemon.client(client_name="third")
    again = [block_hash("closed", i) for i in range(8)]
    assert store(third, again) == again
    assert third.lookup(again).host == len(again)
    third.close()
    fourth = daemon.client(client_name="fourth")
    flood(fourth, "after-close", 4 * HOST_SLOTS)
    assert fourth.lookup(again).host == 0
    assert load(fourth, again) == again  # from disk, exact
    fourth.close()


def test_hits_beyond_the_share_of_holds_are_counted_as_refused(daemon):
    """A session holds at most its share of the slots; a lookup answering more host hits
    than that says so in the statistics, where an operator sees the share is too small."""
    writer, scheduler = daemon.client(client_name="writer"), daemon.client(client_name="sched")
    share = HOST_SLOTS // 2  # the default session_slot_share
    first = [block_hash("share-a", i) for i in range(share - 4)]
    second = [block_hash("share-b", i) for i in range(8)]
    assert store(writer, first) == first and store(writer, second) == second
    assert scheduler.lookup(first).host == len(first)
    assert scheduler.lookup(second).host == len(second)
    layout = daemon.stats().layouts[0]
    assert (layout.held_slots, layout.holds_refused) == (share, 4)
    writer.close()
    scheduler.close()


def test_a_promotion_that_finds_every_slot_held_ends_the_oldest_hold(daemon):
    """Engine A's scheduler holds half the tier for requests not scheduled yet and engine B
    reads the other half: a disk hit A's worker was promised ends A's oldest hold (that block
    is read from disk later, if need be) rather than fail the load."""
    writer = daemon.client(client_name="writer")
    scheduler = daemon.client(client_name="scheduler-a", engine_group="a")
    worker = daemon.client(client_name="worker-a", engine_group="a")
    reader = daemon.client(client_name="worker-b", engine_group="b")
    share = HOST_SLOTS // 2
    on_disk = [block_hash("yield-disk", 0)]
    held = [block_hash("yield-held", i) for i in range(share)]
    read = [block_hash("yield-read", i) for i in range(share)]
    flood(writer, "yield-old", HOST_SLOTS)
    for hashes in (on_disk, held, read):
        assert store(writer, hashes) == hashes
        wait_until(lambda: writer.tools.stats().layouts[0].writing_behind == 0, "the disk writes")
    assert scheduler.lookup(held).host == share
    slots_b = reader.acquire(read)
    assert len(slots_b) == share  # every slot is pinned now: half held, half read
    assert daemon.stats().layouts[0].held_slots == share

    slots, sources = worker.acquire_with_sources(on_disk)
    assert (len(slots), sources.disk) == (1, 1)
    np.testing.assert_array_equal(worker.slab[slots[0]].numpy(), content(on_disk[0]))
    layout = daemon.stats().layouts[0]
    assert (layout.holds_yielded, layout.held_slots) == (1, share - 1)
    worker.release(slots)
    reader.release(slots_b)
    for client in (writer, scheduler, worker, reader):
        client.close()


def test_an_acquire_ends_the_holds_of_its_engine_only(daemon):
    """The engine's scheduler looks up and its worker acquires: the worker's acquire ends the
    scheduler's holds (else they would pin host slots the disk hits need until the deadline),
    while another engine's acquire of the same blocks leaves them held."""
    scheduler = daemon.client(client_name="scheduler", engine_group="engine-a")
    worker = daemon.client(client_name="worker", engine_group="engine-a")
    stranger = daemon.client(client_name="stranger", engine_group="engine-b")
    prefix = [block_hash("group", i) for i in range(8)]
    assert store(worker, prefix) == prefix
    assert scheduler.lookup(prefix).host == len(prefix)
    assert daemon.stats().layouts[0].held_slots == len(prefix)

    slots = stranger.acquire(prefix)
    assert len(slots) == len(prefix)
    stranger.release(slots)
    assert stranger.settle(timeout=30)
    assert daemon.stats().layouts[0].held_slots == len(prefix)

    slots = worker.acquire(prefix[:5])
    assert len(slots) == 5
    assert daemon.stats().layouts[0].held_slots == len(prefix) - 5
    worker.release(slots)
    for client in (scheduler, worker, stranger):
        client.close()


def test_two_lookups_of_a_prefix_hold_it_for_two_acquires(daemon):
    """Two requests sharing a prefix are both told it is in the host tier: the first one's
    acquire must leave it held for the second's."""
    scheduler = daemon.client(client_name="scheduler", engine_group="engine")
    worker = daemon.client(client_name="worker", engine_group="engine")
    prefix = [block_hash("shared", i) for i in range(6)]
    assert store(worker, prefix) == prefix
    assert scheduler.lookup(prefix).host == len(prefix)
    assert scheduler.lookup(prefix[:4]).host == 4  # the second request's shorter prompt
    first = worker.acquire(prefix)
    worker.release(first)
    assert worker.settle(timeout=30)
    assert daemon.stats().layouts[0].held_slots == 4
    second = worker.acquire(prefix[:4])
    worker.release(second)
    assert daemon.stats().layouts[0].held_slots == 0
    scheduler.close()
    worker.close()


def held_back_notices(client) -> tuple[list, Callable]:
    """Keeps the calls ``client``'s index-answered lookups send (their notices) in a list
    instead of sending them; returns it and what sends one."""
    notices: list = []
    calls = client._lookups
    send, calls._notify = calls._notify, notices.append
    return notices, send


def test_host_hits_a_probe_promised_and_lost_before_its_notice_are_counted(daemon):
    """A scheduler answers a lookup from the lookup index and tells the daemon with a call
    nobody waits for, which holds the host hits. Where the host tier evicts them before that
    call arrives, they cannot be held: the daemon counts them (``holds_missed``), so that its
    statistics account for every host hit an engine was promised and then read from disk."""
    writer = daemon.client(client_name="writer")
    scheduler = daemon.client(client_name="sched", lookup_index=True)
    prefix = [block_hash("missed", i) for i in range(8)]
    assert store(writer, prefix) == prefix
    wait_until(lambda: daemon.stats().layouts[0].writing_behind == 0, "the disk writes")
    notices, send = held_back_notices(scheduler)
    assert scheduler.lookup(prefix).host == len(prefix)
    (notice,) = notices
    flood(writer, "missed-flood", 4 * HOST_SLOTS)  # the prefix is on disk alone now
    send(notice)
    wait_until(lambda: daemon.stats().layouts[0].holds_missed == len(prefix), "the late notice")
    layout = daemon.stats().layouts[0]
    assert (layout.held_slots, layout.holds_refused) == (0, 0)
    # A notice that finds its hits holds them and counts none missed.
    again = [block_hash("kept", i) for i in range(4)]
    assert store(writer, again) == again
    assert scheduler.lookup(again).host == len(again)
    (notice,) = notices[1:]
    send(notice)
    wait_until(lambda: daemon.stats().layouts[0].held_slots == len(again), "the notice's holds")
    assert daemon.stats().layouts[0].holds_missed == len(prefix)
    writer.close()
    scheduler.close()


def test_a_notice_holds_no_host_hit_its_probe_did_not_promise(daemon):
    """A probe that found nothing (a new prompt) still sends its call; where that call arrives
    after the prompt's own blocks were stored, it must not hold them: nobody was promised
    them, and a hold would keep them from eviction for ``lookup_hold_s``."""
    writer = daemon.client(client_name="writer")
    scheduler = daemon.client(client_name="sched", lookup_index=True)
    prompt = [block_hash("late", i) for i in range(4)]
    notices, send = held_back_notices(scheduler)
    assert scheduler.lookup(prompt).total == 0
    (notice,) = notices
    assert store(writer, prompt) == prompt  # the prompt ran and was stored meanwhile
    host = next(t for t in daemon.stats().tiers if t.tier == "host")
    send(notice)
    wait_until(
        lambda: (
            next(t for t in daemon.stats().tiers if t.tier == "host").query_tokens
            > host.query_tokens
        ),
        "the late notice",
    )
    layout = daemon.stats().layouts[0]
    assert (layout.held_slots, layout.holds_missed, layout.holds_refused) == (0, 0, 0)
    writer.close()
    scheduler.close()


def test_a_notice_of_several_calls_holds_what_the_probe_found_in_each(daemon):
    """A lookup longer than one call's hashes goes as several; each says how many host hits
    the probe found in its own hashes, so the daemon holds those and none of the request's
    blocks stored after the probe."""
    writer = daemon.client(client_name="writer")
    scheduler = daemon.client(client_name="sched", lookup_index=True)
    scheduler._keeper.limits = dataclasses.replace(scheduler._keeper.limits, max_hashes=3)
    prompt = [block_hash("chunked", i) for i in range(8)]
    assert store(writer, prompt[:5]) == prompt[:5]
    notices, send = held_back_notices(scheduler)
    assert scheduler.lookup(prompt).host == 5
    (notice,) = notices
    assert store(writer, prompt[5:]) == prompt[5:]  # the rest ran and was stored meanwhile
    send(notice)
    wait_until(lambda: daemon.stats().layouts[0].held_slots == 5, "the notice's holds")
    layout = daemon.stats().layouts[0]
    assert (layout.held_slots, layout.holds_missed, layout.holds_refused) == (5, 0, 0)
    writer.close()
    scheduler.close()
