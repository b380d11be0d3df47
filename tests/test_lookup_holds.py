"""A lookup's holds keep one pin of each held slot, however many lookups promised it, and a
lookup of a prefix its session holds already promises it again without walking the host tier
or pinning anything more."""

from __future__ import annotations

import pytest

from kvtier.proto.contract import PROTOCOL_VERSION
from kvtier.service.layout_store import HOST
from kvtier.service.sessions import SessionTable

from daemonutil import block_hash, in_process_daemon

LAYOUT = bytes(16)
BLOCK = 4096
BLOCK_TOKENS = 16


def hashes(tag: str, count: int) -> list[bytes]:
    return [block_hash(tag, i) for i in range(count)]


def test_a_hold_keeps_one_pin_for_all_its_promises():
    table = SessionTable(lease_s=60)
    s = table.open("s", LAYOUT, BLOCK_TOKENS).session_id
    a, b, c = hashes("promises", 3)
    # each hit comes pinned once by its lookup; new holds keep those pins
    assert table.add_holds(s, [(a, 1), (b, 2)], until=5.0, limit=8) == []
    # a prefix held already is promised again, up to the first hash not held or ``at_most``
    assert table.renew_holds(s, [a, b, c], until=6.0, at_most=None) == 2
    assert table.renew_holds(s, [a, b, c], until=6.0, at_most=1) == 1
    # held already: the lookup's pin goes back, the hold gains a promise
    assert table.add_holds(s, [(b, 2), (c, 3)], until=6.0, limit=8) == [2]
    # a: 3 promises, b: 3, c: 1; each acquire ends one, the last one the hold and its pin
    assert table.take_holds(s, [a, b, c]) == [3]
    assert table.drop_promises(s, [a]) == []
    assert table.take_holds(s, [a, b]) == [1]
    assert table.held()[4] == 1
    # the deadline, a yield and the session's end give back one pin per hold
    assert table.expire_holds(now=10.0) == [(LAYOUT, [2])]
    assert table.add_holds(s, [(a, 1), (c, 3)], until=20.0, limit=8) == []
    assert table.renew_holds(s, [a], until=20.0, at_most=None) == 1
    assert table.yield_oldest_hold(LAYOUT) in ([1], [3])
    assert table.close(s).held in ([1], [3])


def test_a_full_share_refuses_new_holds_but_never_a_promise():
    table = SessionTable(lease_s=60)
    s = table.open("s", LAYOUT, BLOCK_TOKENS).session_id
    a, b = hashes("share", 2)
    assert table.add_holds(s, [(a, 1)], until=5.0, limit=1) == []
    assert table.add_holds(s, [(a, 1), (b, 2)], until=5.0, limit=1) == [1, 2]
    assert table.holds_refused[LAYOUT] == 1
    assert table.renew_holds(s, [a, b], until=5.0, at_most=None) == 1


@pytest.fixture
def daemon():
    with in_process_daemon(host_bytes=16 * BLOCK) as d:
        yield d


def test_a_held_prefix_is_looked_up_again_without_a_walk_or_a_pin(daemon, monkeypatch):
    session = daemon.open("engine", LAYOUT, BLOCK, BLOCK_TOKENS, PROTOCOL_VERSION)
    s = session.session.session_id
    stored = hashes("held", 5)
    daemon.commit(s, daemon.reserve(s, stored))
    store = daemon.store.get(LAYOUT)
    table = store.host._slots
    slots = [table.ready_slot(h) for h in stored]

    assert daemon.lookup(s, stored[:4]).host == 4
    assert [table.refs[slot] for slot in slots] == [1, 1, 1, 1, 0]
    walked: list[int] = []
    ready_run = table.ready_run
    monkeypatch.setattr(
        table, "ready_run", lambda hs, *a: walked.append(len(hs)) or ready_run(hs, *a)
    )
    asked = store.counters[HOST].query_tokens
    # the held four are promised again unwalked; only the fifth is walked, pinned and held
    assert daemon.lookup(s, stored).host == 5
    assert walked == [1]
    assert [table.refs[slot] for slot in slots] == [1, 1, 1, 1, 1]
    assert store.counters[HOST].query_tokens - asked == 5 * BLOCK_TOKENS
    # two acquires end the first four's two promises; the fifth had one
    for _ in range(2):
        acquired, _ = daemon.acquire(s, stored)
        daemon.release(s, acquired)
    assert [table.refs[slot] for slot in slots] == [0] * 5
    assert daemon.sessions.held(LAYOUT)[4] == 0
