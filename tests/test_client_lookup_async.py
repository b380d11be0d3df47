"""``DaemonClient.lookup_async``: ``lookup``'s answer without waiting, and never an exception."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from kvtier.tiers.host.tier import LowerHits

from daemonutil import BLOCK_BYTES, Daemon, block_hash, store


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
