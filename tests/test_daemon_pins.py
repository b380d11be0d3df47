"""Pins through a real daemon: a session's pinned blocks survive a flood of other stores that
evicts everything else, until the pin lapses; pins beyond the session's budget are refused and
counted; pins outlive their session; Stats and /metrics show them."""

from __future__ import annotations

import math
import re
import urllib.request

import grpc
import pytest

from kvtier.connector.client.wire import pack_hashes
from kvtier.proto import kvtier_pb2 as pb

from daemonutil import (
    BLOCK_BYTES,
    Daemon,
    block_hash,
    open_session,
    store,
    wait_until,
)

HOST_SLOTS = 32
BUDGET = HOST_SLOTS // 4  # the default pin_share


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=HOST_SLOTS * BLOCK_BYTES).start()
    yield d
    d.cleanup()


def flood(client, tag: str, blocks: int = 4 * HOST_SLOTS) -> None:
    """Stores ``blocks`` unrelated blocks in batches, waiting for each batch's disk write, so
    the host tier's LRU evicts whatever it may."""
    for start in range(0, blocks, 8):
        hashes = [block_hash(tag, i) for i in range(start, start + 8)]
        assert store(client, hashes) == hashes
        wait_until(lambda: client.tools.stats().layouts[0].writing_behind == 0, "the disk writes")


def host_hits(client, hashes: list[bytes]) -> int:
    slots, sources = client.acquire_with_sources(hashes)
    client.release(slots)
    assert client.settle(timeout=30)
    return sources.host


def layout(daemon: Daemon) -> pb.LayoutStats:
    return daemon.stats().layouts[0]


def test_pinned_blocks_survive_a_flood_that_evicts_everything_else(daemon):
    agent, other = daemon.client(client_name="agent"), daemon.client(client_name="other")
    context = [block_hash("context", i) for i in range(BUDGET)]
    unpinned = [block_hash("unpinned", i) for i in range(BUDGET)]
    assert store(agent, context + unpinned) == context + unpinned
    assert agent.tools.pin(context, 600).result(timeout=30) == (BUDGET, 0)
    assert layout(daemon).pinned_blocks == BUDGET
    flood(other, "flood")
    assert host_hits(other, context) == BUDGET
    assert host_hits(other, unpinned) == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.stats_port}/metrics") as reply:
        metrics = reply.read().decode()
    assert re.search(rf'^kvtier_pinned_blocks{{layout="\w+"}} {BUDGET}\.0$', metrics, re.M)
    assert re.search(r'^kvtier_pins_refused_total{layout="\w+"} 0\.0$', metrics, re.M)
    agent.close()
    other.close()


def test_an_expired_pin_frees_its_blocks_to_the_lru(daemon):
    agent, other = daemon.client(client_name="agent"), daemon.client(client_name="other")
    context = [block_hash("short", i) for i in range(BUDGET)]
    assert store(agent, context) == context
    assert agent.tools.pin(context, 0.5).result(timeout=30) == (BUDGET, 0)
    assert layout(daemon).pinned_blocks == BUDGET
    wait_until(lambda: layout(daemon).pinned_blocks == 0, "the pin to lapse")
    flood(other, "after")
    assert host_hits(other, context) == 0
    agent.close()
    other.close()


def test_pins_beyond_the_budget_are_refused_and_counted(daemon):
    agent, other = daemon.client(client_name="agent"), daemon.client(client_name="other")
    blocks = [block_hash("budget", i) for i in range(BUDGET + 3)]
    assert store(agent, blocks) == blocks
    assert agent.tools.pin(blocks, 600).result(timeout=30) == (BUDGET, 3)
    assert agent.tools.pin(blocks[:BUDGET], 900).result(timeout=30) == (BUDGET, 0)  # extends
    stats = layout(daemon)
    assert (stats.pinned_blocks, stats.pins_refused) == (BUDGET, 3)
    # Another session has a budget of its own; a block both pin is one slot, two pins.
    assert other.tools.pin(blocks[BUDGET - 1 :], 600).result(timeout=30) == (4, 0)
    assert layout(daemon).pinned_blocks == BUDGET + 3
    flood(other, "flood")
    assert host_hits(other, blocks) == BUDGET + 3
    agent.close()
    other.close()


def test_pins_outlive_the_session_that_made_them(daemon):
    agent = daemon.client(client_name="agent")
    context = [block_hash("restart", i) for i in range(BUDGET)]
    assert store(agent, context) == context
    assert agent.tools.pin(context, 600).result(timeout=30) == (BUDGET, 0)
    agent.close()  # the agent's engine restarts
    assert layout(daemon).pinned_blocks == BUDGET
    again = daemon.client(client_name="agent")
    flood(again, "flood")
    assert host_hits(again, context) == BUDGET
    more = [block_hash("more", i) for i in range(BUDGET)]
    assert store(again, more) == more
    # The closed session's pins count against nobody: the new one has its whole budget.
    assert again.tools.pin(more, 600).result(timeout=30) == (BUDGET, 0)
    again.close()


def test_a_pin_before_the_commit_takes_the_block_at_its_commit(daemon):
    agent = daemon.client(client_name="agent")
    blocks = [block_hash("early", i) for i in range(4)]
    slots = agent.reserve(blocks)
    assert agent.tools.pin(blocks, 600).result(timeout=30) == (4, 0)
    assert layout(daemon).pinned_blocks == 0
    assert agent.commit(slots)
    assert layout(daemon).pinned_blocks == 4
    agent.close()


def test_bad_pins_are_refused_with_a_clear_status(daemon):
    channel, stub = daemon.stub()
    with channel:
        session = open_session(stub).session_id
        packed = pack_hashes([block_hash("bad", 0)])
        for seconds in (0.0, -1.0, 3601.0, math.nan):
            with pytest.raises(grpc.RpcError) as err:
                stub.Pin(pb.PinRequest(session_id=session, hashes=packed, seconds=seconds))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Pin(pb.PinRequest(session_id=session, hashes=b"\0" * 15, seconds=1.0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Pin(pb.PinRequest(session_id="nobody", hashes=packed, seconds=1.0))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    client = daemon.client()
    failures = client.failures
    assert client.tools.pin([block_hash("bad", 0)], 0.0).result(timeout=30) == (0, 0)
    assert client.failures == failures + 1
    client.close()
