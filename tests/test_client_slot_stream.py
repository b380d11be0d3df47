"""The client's slot operations over its session's slot channel or ``SlotOps`` stream: the same
answers, the same deadline and breaker, and a stream that breaks costs the operations waiting
on it only what their calls cut off would cost, then calls go unary until a new stream opens."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from daemonutil import BLOCK_BYTES, Daemon, block_hash, load, store, wait_until

TIMEOUT_S = 0.5
WITHOUT_SLOT_OPS = (
    "import runpy, sys; "
    "from kvtier.service.rpc.servicer import KvTierServicer; "
    "del KvTierServicer.SlotOps; "
    "sys.argv[0] = 'kvtier.service.serve'; "
    "runpy.run_module('kvtier.service.serve', run_name='__main__')"
)
"""``python -c WITHOUT_SLOT_OPS ARGS…``: the daemon as a build from before ``SlotOps``
serves it: the generated servicer's own SlotOps answers UNIMPLEMENTED."""


@dataclass
class DaemonWithoutSlotOps(Daemon):
    """A real daemon, less its ``SlotOps`` stream: what an engine upgraded before its node's
    daemon talks to."""

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("-m")
        return [*cmd[:at], "-c", WITHOUT_SLOT_OPS, *cmd[at + 2 :]]


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        d.proc.send_signal(signal.SIGCONT)
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


WAYS = ("channel", "stream")
"""The slot channel (the default on this host) and the ``SlotOps`` stream (its fallback)."""


def held(daemon: Daemon) -> tuple[int, int]:
    stats = daemon.stats()
    return stats.reserved_slots, stats.acquired_slots


def opened(client, way: str) -> int:
    """Streams of ``way`` the client opened; none of the other way."""
    calls = client.slot_calls
    other = calls.streams_opened if way == "channel" else calls.channels_opened
    assert other == 0
    return calls.channels_opened if way == "channel" else calls.streams_opened


@pytest.mark.parametrize("way", WAYS)
def test_stores_and_loads_go_over_the_stream(daemon, way):
    with daemon.client(slot_stream=True, slot_channel=way == "channel") as client:
        hashes = [block_hash("streamed", i) for i in range(8)]
        assert store(client, hashes) == hashes
        assert load(client, hashes) == hashes
        assert client.settle(30)
        assert client.slot_calls.streamed >= 4  # reserve, commit, acquire, release
        assert opened(client, way) == 1
        assert (client.failures, client.slot_calls.fallbacks) == (0, 0)
        assert held(daemon) == (0, 0)


@pytest.mark.parametrize("way", WAYS)
def test_an_operation_past_its_deadline_trips_the_breaker_and_leaks_nothing(daemon, way):
    client = daemon.client(
        slot_stream=True, slot_channel=way == "channel", timeout_s=TIMEOUT_S, lookup_index=False
    )
    hashes = [block_hash("frozen", i) for i in range(4)]
    assert store(client, hashes) == hashes
    with daemon.frozen():
        assert client.acquire(hashes) == []  # waited out its deadline
        assert client.breaker.trips == 1
        assert client.reserve([block_hash("new", 0)])[0] < 0  # at once: the breaker is open
        assert client.breaker.short_circuited >= 1
    wait_until(lambda: not client.breaker.is_open, "the breaker to close")
    # the late acquire's slots came back through its Cancel; the session went on
    wait_until(lambda: held(daemon) == (0, 0), "the late acquire's slots to come back")
    assert load(client, hashes) == hashes
    assert client.sessions_opened == 1
    client.close()


@pytest.mark.parametrize("way", WAYS)
def test_a_reserve_goes_out_behind_a_release_on_its_stream_without_waiting_for_its_answer(
    daemon, way
):
    # The daemon starts a stream's operations in order and answers a Release as it starts
    # it, so the Reserve behind it sees the room it made: it is sent at once, not after the
    # Release's answer (a frozen daemon answers neither until it goes on).
    with daemon.client(slot_stream=True, slot_channel=way == "channel", timeout_s=30) as client:
        hashes = [block_hash("ordered", i) for i in range(4)]
        assert store(client, hashes) == hashes
        slots = client.acquire(hashes)
        assert len(slots) == len(hashes)
        with ThreadPoolExecutor(1) as pool, daemon.frozen():
            client.release(slots)
            sent = client.slot_calls.streamed
            reserving = pool.submit(client.reserve, [block_hash("behind", 0)])
            wait_until(lambda: client.slot_calls.streamed > sent, "the Reserve to go out")
        reserved = reserving.result(timeout=60)
        assert reserved[0] >= 0
        assert client.commit(reserved)
        assert client.settle(30)
        assert (client.failures, client.breaker.trips) == (0, 0)
        assert held(daemon) == (0, 0)


@pytest.mark.parametrize("way", WAYS)
def test_a_broken_stream_fails_what_waits_on_it_then_calls_go_unary_until_a_new_one(daemon, way):
    client = daemon.client(slot_stream=True, slot_channel=way == "channel", timeout_s=60)
    hashes = [block_hash("broken", i) for i in range(4)]
    assert store(client, hashes) == hashes
    got: list[list[int]] = []
    with daemon.frozen():
        loading = threading.Thread(target=lambda: got.append(client.acquire(hashes)))
        loading.start()
        wait_until(lambda: client.slot_calls.streamed >= 3, "the acquire to be on the stream")
        client.slot_calls._stream.close()  # the stream breaks under the waiting acquire
        loading.join(60)
        assert not loading.is_alive(), "the acquire still waits on the broken stream"
        assert got == [[]]
        assert client.failures == 1
    # the acquire's Cancel went unary (the stream is broken) and gave its slots back
    assert client.settle(60)
    wait_until(lambda: held(daemon) == (0, 0), "the cut-off acquire's slots to come back")
    assert client.slot_calls.fallbacks >= 1
    assert client.sessions_opened == 1
    wait_until(
        lambda: load(client, hashes) == hashes and opened(client, way) == 2,
        "a new stream to open",
    )
    assert client.settle(60)
    assert held(daemon) == (0, 0)
    assert not client.breaker.is_open
    client.close()


def test_a_daemon_without_slot_ops_is_called_unary_and_nothing_fails():
    daemon = DaemonWithoutSlotOps(host_bytes=64 * BLOCK_BYTES).start()
    try:
        # A build from before SlotOps has no slot channel either.
        with daemon.client(slot_stream=True, slot_channel=False) as client:

            def store_and_load(worker: int) -> list[bytes]:
                hashes = [block_hash(f"old-daemon-{worker}", i) for i in range(4)]
                assert store(client, hashes) == hashes
                return load(client, hashes)

            # Four threads at once: the operations queued on the first stream all come back
            # UNIMPLEMENTED and are sent again unary, none counted as a failure.
            with ThreadPoolExecutor(4) as pool:
                loaded = list(pool.map(store_and_load, range(4)))
            assert all(len(hashes) == 4 for hashes in loaded)
            assert client.settle(30)
            assert not client.slot_calls.streaming
            assert client.slot_calls.streams_opened == 1
            assert (client.failures, client.breaker.trips, client.sessions_opened) == (0, 0, 1)
            assert held(daemon) == (0, 0)
        assert daemon.stop() == 0, daemon.log.read_text()
    finally:
        daemon.cleanup()
