"""``DaemonClient.lookup_async``: ``lookup``'s answer without waiting, and never an exception."""

from __future__ import annotations

import dataclasses
import signal
import threading

import pytest

from kvtier.connector.client.index_reader import load_probe
from kvtier.tiers.host.tier import LowerHits

from daemonutil import BLOCK_BYTES, Daemon, block_hash, store, wait_until


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=32 * BLOCK_BYTES).start()
    yield d
    d.cleanup()


def test_answers_like_lookup_chunk_by_chunk(daemon) -> None:
    client = daemon.client()
    try:
        hashes = [block_hash("chunks", i) for i in range(10)]
        store(client, hashes[:7])
        # the held prefix spans three chunks, and ends inside one
        client._keeper.limits = dataclasses.replace(client._keeper.limits, max_hashes=3)
        assert client.lookup_async(hashes).result(timeout=30) == LowerHits(host=7)
        assert client.lookup_async(hashes[:6]).result(timeout=30) == LowerHits(host=6)
        assert client.lookup_async(hashes[7:]).result(timeout=30) == LowerHits()
        assert client.lookup_async([]).result(timeout=0) == LowerHits()
        assert client.failures == 0
    finally:
        client.close()


def test_a_frozen_daemon_does_not_block_the_caller(daemon) -> None:
    """The call path (the index would answer at once from memory)."""
    client = daemon.client(lookup_index=False)
    try:
        hashes = [block_hash("frozen", i) for i in range(4)]
        store(client, hashes)
        with daemon.frozen():
            answer = client.lookup_async(hashes)
            assert not answer.done()  # returned while the daemon cannot answer
        assert answer.result(timeout=30) == LowerHits(host=4)
    finally:
        client.close()


def test_a_dead_daemon_is_a_counted_miss(daemon) -> None:
    client = daemon.client()
    try:
        hashes = [block_hash("dead", i) for i in range(4)]
        store(client, hashes)
        daemon.kill(signal.SIGKILL)
        answer = client.lookup_async(hashes)
        assert answer.result(timeout=30) == LowerHits()
        assert client.failures >= 1
    finally:
        client.close()


@pytest.mark.parametrize("lookup_index", [True, False])
def test_lookup_then_hands_over_the_answer_at_once_only_where_the_index_gives_it(
    daemon, lookup_index
) -> None:
    """The scheduler's path: no future; an index answer reaches ``then`` before the call
    returns, on the caller's thread; without the index a call answers (on whichever thread
    its reply lands: a fast reply can beat ``add_done_callback`` to it)."""
    client = daemon.client(lookup_index=lookup_index)
    try:
        hashes = [block_hash("then", i) for i in range(6)]
        store(client, hashes[:4])
        if lookup_index:
            assert load_probe()
            wait_until(lambda: client.lookup(hashes) == LowerHits(host=4), "the index")
        answers: list[tuple[LowerHits, str]] = []
        landed = threading.Event()

        def then(hits: LowerHits) -> None:
            answers.append((hits, threading.current_thread().name))
            landed.set()

        probed = client._lookups.probed
        client.lookup_then(hashes, then)
        if lookup_index:
            assert answers == [(LowerHits(host=4), threading.current_thread().name)]
        assert landed.wait(30)
        ((hits, _),) = answers
        assert hits == LowerHits(host=4)
        assert client._lookups.probed == probed + lookup_index
        client.lookup_then([], then)
        assert answers[-1][0] == LowerHits()  # nothing to ask: a miss at once
        assert client.failures == 0
    finally:
        client.close()
