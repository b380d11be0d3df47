"""The slot channel: a session's slot operations over the daemon's own unix socket for them,
bound to the process that opened the session, with the gRPC stream as its fallback."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvtier.connector.client.slot_answers import PendingOps
from kvtier.connector.client.slot_channel import ChannelStream
from kvtier.connector.client.wire import pack_hashes
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import HASH_BYTES

from daemonutil import BLOCK_BYTES, Daemon, block_hash, load, store, wait_until

OTHER_PROCESS = """
import socket, sys
from kvtier.proto import contract, kvtier_pb2 as pb
path, session, hashes = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
op = pb.SlotOp(op_id=1, reserve=pb.ReserveRequest(session_id=session, hashes=hashes))
raw = pb.SlotOpBatch(session_id=session, ops=[op]).SerializeToString()
with socket.socket(socket.AF_UNIX) as s:
    s.connect(path)
    s.sendall(contract.FRAME.pack(len(raw)) + raw)
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
while data:
    (size,) = contract.FRAME.unpack_from(data)
    for r in pb.SlotResultBatch.FromString(data[4 : 4 + size]).results:
        print(r.op_id, r.code, r.message)
    data = data[4 + size :]
"""
"""``python -c OTHER_PROCESS PATH SESSION HASHES``: a process that names another's session on
the channel; prints each result it gets (op id, code, message)."""


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def frames(sock: socket.socket) -> list[pb.SlotResultBatch]:
    """Every frame the daemon sends until it ends the channel."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    batches = []
    while data:
        (size,) = contract.FRAME.unpack_from(data)
        batches.append(pb.SlotResultBatch.FromString(data[4 : 4 + size]))
        data = data[4 + size :]
    return batches


@contextlib.contextmanager
def raw_channel(daemon: Daemon, client) -> Iterator[tuple[socket.socket, str]]:
    """A connection of this process to the daemon's slot channel, and ``client``'s session
    (the one this process may name on it)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.fspath(contract.slot_channel_path(daemon.socket)))
        yield sock, client.slot_calls._keeper.session


def send(sock: socket.socket, batch: pb.SlotOpBatch) -> None:
    raw = batch.SerializeToString()
    sock.sendall(contract.FRAME.pack(len(raw)) + raw)


def next_frame(sock: socket.socket) -> pb.SlotResultBatch:
    """The daemon's next frame on ``sock``."""
    (size,) = contract.FRAME.unpack(sock.recv(contract.FRAME.size, socket.MSG_WAITALL))
    return pb.SlotResultBatch.FromString(sock.recv(size, socket.MSG_WAITALL))


def channel_holds(daemon: Daemon) -> float:
    """The daemon's ``kvtier_slot_channel_holds_total``."""
    url = f"http://127.0.0.1:{daemon.stats_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return float(re.search(r"^kvtier_slot_channel_holds_total (\S+)$", text, re.M).group(1))


def test_the_channel_socket_is_the_daemons_users_alone(daemon):
    path = contract.slot_channel_path(daemon.socket)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)


def test_another_process_cannot_use_a_session_over_the_channel(daemon):
    with daemon.client() as client:
        session = client.slot_calls._keeper.session
        hashes = pack_hashes([block_hash("stolen", 0)])
        path = os.fspath(contract.slot_channel_path(daemon.socket))
        out = subprocess.run(
            [sys.executable, "-c", OTHER_PROCESS, path, session, hashes.hex()],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        # one result: the channel's end, PERMISSION_DENIED; the reserve never ran
        assert out[:2] == ["0", str(grpc.StatusCode.PERMISSION_DENIED.value[0])], out
        assert daemon.stats().reserved_slots == 0
        # the session is still its own process's, over the channel
        assert store(client, [block_hash("own", 0)]) == [block_hash("own", 0)]
        assert client.slot_calls.channels_opened == 1


def test_a_session_of_this_process_is_served_and_a_bad_frame_ends_only_its_channel(daemon):
    with daemon.client() as client:
        reserve = pb.ReserveRequest(hashes=pack_hashes([block_hash("raw", 0)]))
        with raw_channel(daemon, client) as (sock, session):
            send(
                sock, pb.SlotOpBatch(session_id=session, ops=[pb.SlotOp(op_id=7, reserve=reserve)])
            )
            answered = next_frame(sock)
            sock.sendall(contract.FRAME.pack(3) + b"\xff" * 3)  # undecodable
            results = [*answered.results, *(r for batch in frames(sock) for r in batch.results)]
        assert [(r.op_id, r.code) for r in results] == [
            (7, 0),
            (0, grpc.StatusCode.INVALID_ARGUMENT.value[0]),
        ]
        abort = pb.SlotsRequest(session_id=session, slots=list(results[0].reserve.slots))
        client._stub.Abort(abort, timeout=10)
        hashes = [block_hash("after", i) for i in range(4)]
        assert store(client, hashes) == hashes
        assert load(client, hashes) == hashes
        assert client.failures == 0


def test_a_client_that_reads_no_answers_is_held_and_then_answered_in_full(daemon):
    # 100,000 answers are more than the socket's buffers and the daemon's write buffer hold:
    # the daemon stops reading this channel (and counts it) until the client reads, then takes
    # the frames it held back. Every operation is answered once, and the channel serves on.
    with daemon.client() as client, raw_channel(daemon, client) as (sock, session):
        flood = b"".join(
            contract.FRAME.pack(len(raw)) + raw
            for raw in (
                pb.SlotOpBatch(
                    session_id=session,
                    ops=[
                        pb.SlotOp(op_id=i, cancel=pb.CancelRequest(call_id=i))
                        for i in range(first, first + 1000)
                    ],
                ).SerializeToString()
                for first in range(1, 100_001, 1000)
            )
        )
        sender = threading.Thread(target=sock.sendall, args=(flood,))
        sender.start()
        wait_until(lambda: channel_holds(daemon) >= 1, "the daemon to stop reading")
        answered = collections.Counter()
        while sum(answered.values()) < 100_000:
            for result in next_frame(sock).results:
                assert result.code == 0, result.message
                answered[result.op_id] += 1
        sender.join()
        assert set(answered) == set(range(1, 100_001))
        assert set(answered.values()) == {1}
        hashes = [block_hash("after-flood", i) for i in range(4)]
        assert store(client, hashes) == hashes
        assert client.failures == 0


@pytest.fixture
def holding_daemon():
    """A daemon whose lookups hold their hits for longer than any test runs."""
    d = Daemon(host_bytes=64 * BLOCK_BYTES, extra=["--lookup-hold-s", "3600"]).start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def notice_and_acquire(session: str, hashes: list[bytes]) -> pb.SlotOpBatch:
    """One frame: a notice of ``hashes`` (op 1: a lookup the index answered, all its hits
    in the host tier) and an Acquire of the first two (op 2), in that order."""
    packed = pack_hashes(hashes)
    notice = pb.LookupRequest(hashes=packed, probed_host=len(hashes))
    acquire = pb.AcquireRequest(hashes=packed[: 2 * HASH_BYTES])
    return pb.SlotOpBatch(
        session_id=session,
        ops=[pb.SlotOp(op_id=1, lookup=notice), pb.SlotOp(op_id=2, acquire=acquire)],
    )


def test_a_notice_yields_to_the_acquire_that_came_with_it_and_still_holds(holding_daemon):
    # The Acquire is answered before the notice nobody waits for, and in a frame of its own.
    # It took no hold (the notice had made none yet), so each of the four hits is held.
    with holding_daemon.client() as client, raw_channel(holding_daemon, client) as conn:
        sock, session = conn
        hashes = [block_hash("notice", i) for i in range(4)]
        assert store(client, hashes) == hashes
        send(sock, notice_and_acquire(session, hashes))
        answered: dict[int, tuple[int, pb.SlotResult]] = {}  # op id -> (frame, result)
        frames_read = 0
        while len(answered) < 2:
            answered.update((r.op_id, (frames_read, r)) for r in next_frame(sock).results)
            frames_read += 1
        (acquire_frame, acquired), (notice_frame, noticed) = answered[2], answered[1]
        assert acquire_frame < notice_frame
        assert (acquired.code, noticed.code) == (0, 0)
        assert len(acquired.acquire.slots) == 2 and noticed.lookup.host == 4
        layout = holding_daemon.stats().layouts[0]
        assert (layout.acquired_slots, layout.held_slots, layout.holds_missed) == (2, 4, 0)
        release = pb.SlotsRequest(slots=acquired.acquire.slots)
        send(sock, pb.SlotOpBatch(session_id=session, ops=[pb.SlotOp(op_id=3, release=release)]))
        assert [(r.op_id, r.code) for r in next_frame(sock).results] == [(3, 0)]
        assert holding_daemon.stats().layouts[0].acquired_slots == 0


def test_a_notice_sent_as_the_client_ends_its_side_is_run_and_answered(daemon):
    with daemon.client() as client, raw_channel(daemon, client) as (sock, session):
        hashes = [block_hash("last-notice", i) for i in range(3)]
        assert store(client, hashes) == hashes
        notice = pb.LookupRequest(hashes=pack_hashes(hashes), probed_host=3)
        send(sock, pb.SlotOpBatch(session_id=session, ops=[pb.SlotOp(op_id=5, lookup=notice)]))
        sock.shutdown(socket.SHUT_WR)
        results = [r for batch in frames(sock) for r in batch.results]
    assert [(r.op_id, r.code, r.lookup.host) for r in results] == [(5, 0, 3)]


def test_a_waiting_caller_reads_its_answer_itself(daemon, monkeypatch):
    """A caller that waits reads the answers off the channel where no other thread is
    reading: no second thread wakes between the answer and its caller. (The reader thread
    still takes some: the unwaited Releases', and those that came while it held the channel a
    moment; 11-22 of 80 on the 2-core VM with two busy processes beside the test.)"""
    readers: list[str] = []
    answer = PendingOps.answer

    def recording_answer(self, result):
        readers.append(threading.current_thread().name)
        answer(self, result)

    monkeypatch.setattr(PendingOps, "answer", recording_answer)
    with daemon.client(lookup_index=False) as client:
        for i in range(20):
            hashes = [block_hash("caller-reads", 2 * i + j) for j in range(2)]
            assert store(client, hashes) == hashes
            assert load(client, hashes) == hashes
        assert client.slot_calls.channels_opened >= 1 and client.failures == 0
    caller = threading.current_thread().name
    assert readers.count(caller) >= len(readers) // 4, collections.Counter(readers)


def test_a_stopping_daemon_ends_each_channel_with_unavailable(daemon):
    cancel = pb.SlotOp(op_id=3, cancel=pb.CancelRequest(call_id=9))
    with daemon.client() as client, raw_channel(daemon, client) as (sock, session):
        send(sock, pb.SlotOpBatch(session_id=session, ops=[cancel]))
        first = next_frame(sock)
        assert [(r.op_id, r.code) for r in first.results] == [(3, 0)]
        assert daemon.stop() == 0, daemon.log.read_text()
        results = [r for batch in frames(sock) for r in batch.results]
    assert [(r.op_id, r.code, r.message) for r in results] == [
        (0, grpc.StatusCode.UNAVAILABLE.value[0], "daemon stopping")
    ]


def test_a_daemon_without_a_slot_channel_is_reached_over_the_stream(daemon):
    contract.slot_channel_path(daemon.socket).unlink()  # as a daemon from before the channel
    with daemon.client() as client:
        hashes = [block_hash("no-channel", i) for i in range(4)]
        assert store(client, hashes) == hashes
        assert load(client, hashes) == hashes
        assert client.settle(30)
        calls = client.slot_calls
        assert (calls.channels_opened, calls.streams_opened, client.failures) == (0, 1, 0)


def test_channels_beyond_the_cap_are_ended_at_once_and_the_rest_still_served():
    daemon = Daemon(host_bytes=64 * BLOCK_BYTES, extra=["--max-sessions", "1"]).start()
    try:
        path = os.fspath(contract.slot_channel_path(daemon.socket))
        idle = [socket.socket(socket.AF_UNIX) for _ in range(2)]  # the cap: 2 per session
        try:
            for sock in idle:
                sock.connect(path)
            with socket.socket(socket.AF_UNIX) as extra:
                extra.connect(path)
                results = [r for batch in frames(extra) for r in batch.results]
            assert [(r.op_id, r.code) for r in results] == [
                (0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            ]
        finally:
            for sock in idle:
                sock.close()
        # the idle ones gone, a client's own channel is served again
        with daemon.client() as client:
            hashes = [block_hash("capped", i) for i in range(2)]
            wait_until(lambda: store(client, hashes) == hashes, "a store over the channel")
            assert client.slot_calls.channels_opened >= 1
        assert daemon.stop() == 0, daemon.log.read_text()
    finally:
        daemon.cleanup()


def test_a_garbled_answer_read_by_its_caller_fails_every_waiter_and_hangs_none():
    """A frame that does not parse ends the channel, read by a waiting caller as by the
    reader thread: every operation still waiting fails as UNAVAILABLE, at once."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stream = ChannelStream(mine, "s")

    def garble_once_a_caller_reads() -> None:
        # Nothing was sent yet, so the reader thread holds no lock: the caller does.
        wait_until(stream._reading.locked, "a caller reading the channel")
        theirs.sendall(contract.FRAME.pack(8) + b"\xff" * 8)

    sender = threading.Thread(target=garble_once_a_caller_reads)
    try:
        first, second = (
            stream.put(op_id, "Commit", pb.SlotsRequest(session_id="s", slots=[op_id]), 30)
            for op_id in (1, 2)
        )
        sender.start()
        for future in (first, second):
            with pytest.raises(grpc.RpcError) as failed:
                stream.wait(future, 30)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        sender.join()
        stream.close()
        theirs.close()
