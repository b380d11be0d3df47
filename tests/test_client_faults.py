"""The client against a frozen daemon (SIGSTOP): one deadline, not one per call, and a late
chunk that costs that chunk only — the session, and the slots it already holds, go on."""

from __future__ import annotations

import signal

import pytest

from daemonutil import BLOCK_BYTES, Daemon, block_hash, content, load, store, wait_until

TIMEOUT_S = 0.5


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        d.proc.send_signal(signal.SIGCONT)
    d.cleanup()


def test_a_frozen_daemon_costs_one_deadline_then_calls_miss_at_once(daemon):
    client = daemon.client(timeout_s=TIMEOUT_S, lookup_index=False)
    hashes = [block_hash("frozen", i) for i in range(4)]
    assert store(client, hashes) == hashes
    with daemon.frozen():
        for _ in range(20):
            assert client.lookup(hashes).total == 0
        assert client.reserve([block_hash("new", 0)])[0] < 0
        assert client.acquire(hashes) == []
        assert client.breaker.trips == 1
        assert client.breaker.short_circuited >= 21  # only the first call waited
    wait_until(lambda: not client.breaker.is_open, "the breaker to close")
    assert load(client, hashes) == hashes
    assert client.sessions_opened == 1
    client.close()


def test_a_frozen_daemon_still_answers_lookups_from_its_index_until_a_call_trips(daemon):
    """The index is memory: a frozen daemon's probes still answer (a hint, which the acquire
    confirms); the first call waits out its deadline and opens the breaker, and from then on
    lookups miss at once like every call."""
    client = daemon.client(timeout_s=TIMEOUT_S, lookup_index=True)
    hashes = [block_hash("frozen-index", i) for i in range(4)]
    assert store(client, hashes) == hashes
    probed = client._lookups.probed
    with daemon.frozen():
        assert client.lookup(hashes).host == 4
        assert client._lookups.probed == probed + 1
        assert client.acquire(hashes) == []
        assert client.breaker.is_open
        assert client.lookup(hashes).total == 0
        assert client.breaker.trips == 1
    wait_until(lambda: not client.breaker.is_open, "the breaker to close")
    assert load(client, hashes) == hashes
    client.close()


@pytest.fixture(params=[False, True], ids=["unary", "stream"])
def slot_stream(request) -> bool:
    """Whether the client sends its slot operations over its ``SlotOps`` stream."""
    return request.param


def test_a_late_acquire_chunk_fails_that_chunk_only(daemon, slot_stream):
    client = daemon.client(
        timeout_s=TIMEOUT_S, chunk_bytes=4 * BLOCK_BYTES, slot_stream=slot_stream
    )
    hashes = [block_hash("chunked", i) for i in range(8)]
    assert store(client, hashes) == hashes
    call = client.slot_calls.call
    calls = []

    def first_then_freeze(method, request, timeout):
        reply = call(method, request, timeout)
        calls.append(len(reply.slots))
        if len(calls) == 1:
            daemon.proc.send_signal(signal.SIGSTOP)  # the second chunk will be late
        return reply

    client.slot_calls.call = first_then_freeze
    try:
        slots = client.acquire(hashes)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    client.slot_calls.call = call
    assert calls == [4] and len(slots) == 4  # the first chunk, and nothing of the second
    wait_until(lambda: not client.breaker.is_open, "the breaker to close")
    assert client.settle(timeout=30)  # the Cancel of the late chunk was answered
    assert daemon.stats().acquired_slots == 4  # what the late chunk took came back
    for h, slot in zip(hashes, slots, strict=False):
        assert (client.slab[slot].numpy() == content(h)).all()
    client.release(slots)
    assert client.settle(timeout=30)
    assert daemon.stats().acquired_slots == 0
    assert client.sessions_opened == 1  # the session went on throughout
    assert load(client, hashes) == hashes
    client.close()


def _reserve_and_fill(client, hashes):
    slots = client.reserve(hashes)
    assert min(slots) >= 0
    for h, slot in zip(hashes, slots, strict=True):
        client.slab[slot].numpy()[:] = content(h)
    return slots


def test_a_late_commit_chunk_fails_that_chunk_only(daemon, slot_stream):
    client = daemon.client(
        timeout_s=TIMEOUT_S, chunk_bytes=4 * BLOCK_BYTES, slot_stream=slot_stream
    )
    hashes = [block_hash("commit-late", i) for i in range(12)]
    slots = _reserve_and_fill(client, hashes)
    call = client.slot_calls.call
    calls = []

    def second_is_late(method, request, timeout):
        calls.append(list(request.slots))
        if len(calls) == 2:
            with daemon.frozen():
                return call(method, request, timeout)
        return call(method, request, timeout)

    client.slot_calls.call = second_is_late
    assert not client.commit(slots)
    client.slot_calls.call = call
    assert calls == [slots[:4], slots[4:8]]  # the breaker opened: the third chunk missed at once
    wait_until(lambda: not client.breaker.is_open, "the breaker to close")
    assert client.settle(timeout=30)
    assert daemon.stats().reserved_slots == 0  # the late chunk and the one after came back
    assert load(client, hashes[:4]) == hashes[:4]
    assert client.sessions_opened == 1
    client.close()


def test_a_refused_commit_chunk_costs_that_chunk_only(daemon, slot_stream):
    """A chunk the daemon refuses (here: it names a slot the session never reserved) is
    aborted; the chunks after it are still committed."""
    client = daemon.client(
        timeout_s=TIMEOUT_S, chunk_bytes=4 * BLOCK_BYTES, slot_stream=slot_stream
    )
    hashes = [block_hash("commit-refused", i) for i in range(12)]
    slots = _reserve_and_fill(client, hashes)
    stray = next(s for s in range(len(client.slab)) if s not in slots)
    call = client.slot_calls.call
    calls = []

    def second_is_refused(method, request, timeout):
        calls.append(len(calls))
        if len(calls) == 2:
            request = type(request)(session_id=request.session_id, slots=[*request.slots, stray])
        return call(method, request, timeout)

    client.slot_calls.call = second_is_refused
    assert not client.commit(slots)
    client.slot_calls.call = call
    assert len(calls) == 3 and not client.breaker.is_open
    assert client.settle(timeout=30)
    assert daemon.stats().reserved_slots == 0
    assert load(client, hashes) == hashes[:4]  # the refused chunk is a miss ...
    assert load(client, hashes[8:]) == hashes[8:]  # ... and the one after it was stored
    assert client.sessions_opened == 1
    client.close()


def test_a_new_session_closes_the_breaker(daemon):
    """A restarted daemon is used from the session that reattaches the client, not from the
    breaker's next probe (which, here, never succeeds)."""
    client = daemon.client(timeout_s=TIMEOUT_S)
    hashes = [block_hash("restart", i) for i in range(4)]
    assert store(client, hashes) == hashes
    wait_until(lambda: client.tools.stats().layouts[0].writing_behind == 0, "the disk writes")
    client.breaker._probe = lambda: False
    daemon.kill()
    wait_until(lambda: not client.connected, "the session to be lost")
    assert client.lookup(hashes).total == 0
    client.breaker.trip("the daemon is gone")
    assert client.breaker.is_open
    daemon.start()
    wait_until(lambda: client.connected, "the client to reattach")
    assert not client.breaker.is_open
    assert client.lookup(hashes).total == len(hashes)  # committed before the kill, on disk
    client.close()


def test_the_clients_of_one_daemon_in_a_process_share_one_deadline(daemon):
    """vLLM's scheduler and worker each hold a client: a frozen daemon costs the engine one
    deadline, not one per client; a client that closes leaves the breaker to the others."""
    first = daemon.client(timeout_s=TIMEOUT_S, lookup_index=False)
    second = daemon.client(timeout_s=TIMEOUT_S, lookup_index=False)
    hashes = [block_hash("shared", i) for i in range(4)]
    assert store(first, hashes) == hashes
    with daemon.frozen():
        assert first.lookup(hashes).total == 0  # waits out its deadline
        assert second.lookup(hashes).total == 0  # misses at once
        assert (first.breaker.trips, second.breaker.short_circuited) == (1, 1)
    first.close()
    wait_until(lambda: not second.breaker.is_open, "the breaker to close (second's probe)")
    assert load(second, hashes) == hashes
    second.close()


def test_a_trip_ends_the_lookups_still_waiting(daemon):
    """A lookup sent to a frozen daemon is a miss as soon as any call of the process finds
    the daemon not answering, not at its own deadline: vLLM's scheduler keeps a request
    waiting until its lookup is answered."""
    patient = daemon.client(timeout_s=600, lookup_index=False)
    other = daemon.client(timeout_s=TIMEOUT_S, lookup_index=False)
    hashes = [block_hash("waiting", i) for i in range(4)]
    assert store(patient, hashes) == hashes
    with daemon.frozen():
        waiting = patient.lookup_async(hashes)
        assert other.lookup(hashes).total == 0  # waits out its deadline: the breaker opens
        assert waiting.result(timeout=60).total == 0
    wait_until(lambda: not patient.breaker.is_open, "the breaker to close")
    assert patient.lookup(hashes).total == len(hashes)
    patient.close()
    other.close()
