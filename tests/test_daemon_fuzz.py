"""10,000 random and mutated RPCs against a real daemon, with another client's blocks inside.

Every method gets requests of three kinds, from a fixed seed: well-formed messages with random
field values (with and without a real session, so the deep paths run), valid messages with
random bytes flipped, cut or appended, and plain garbage. ``SlotOps`` streams get batches of
random operations: any kind or none, another session's, slots out of range, oversized batches,
garbage ids, slots reserved ahead and Commits naming them; the same batches go as frames over
the slot channel too, some with a length that lies or cut short. Afterwards the daemon must
still be SERVING, every call and every operation of a stream must have been answered with a
status that is not UNKNOWN (an exception of our own code), its memory and its log must have
grown by a bounded amount, and the blocks another client stored before the storm must come
back exact.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb

from daemonutil import BLOCK_BYTES, SIGNATURE, Daemon, block_hash, load, open_session, store

CALLS = 10_000
CHANNEL_CALLS = 1_000
SEED = 20261122
RSS_GROWTH_LIMIT = 256 << 20
LOG_LINES_LIMIT = 400
_METHODS = pb.DESCRIPTOR.services_by_name["KvTier"].methods


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(match.group(1)) << 10


class Fuzzer:
    """Builds one request per call: a random message, a mutated one, or garbage."""

    def __init__(self, rng: random.Random, sessions: list[str], stream_sessions: list[str]):
        self.rng = rng
        self.sessions = sessions
        self.stream_sessions = stream_sessions
        """Sessions only ``SlotOps`` streams serve (no fuzzed Close ends them), so that their
        operations reach the tiers."""
        self.slots: list[int] = list(range(8))

    def hashes(self) -> bytes:
        count = self.rng.choice([0, 1, 2, 5, 64, 3000])
        packed = self.rng.randbytes(16 * count)
        if self.rng.random() < 0.2:
            packed += self.rng.randbytes(self.rng.randrange(1, 16))
        return packed

    def session(self) -> str:
        if self.rng.random() < 0.8:
            return self.rng.choice(self.sessions)
        return self.rng.choice(["", "nope", "x" * 500, self.rng.randbytes(8).hex()])

    def message(self, name: str) -> object:
        r = self.rng
        match name:
            case "Open":
                return pb.OpenRequest(
                    client_name=r.choice(["fuzz", "", "y" * 1000]),
                    layout_signature=r.choice([SIGNATURE, r.randbytes(16), r.randbytes(3)]),
                    block_bytes=r.choice([BLOCK_BYTES, 0, 1, 4095, 2**40, r.randrange(2**20)]),
                    block_tokens=r.randrange(2**32),
                    protocol_version=r.choice([contract.PROTOCOL_VERSION, 0, 1, 99]),
                    client_pid=r.randrange(2**32),
                    client_pid_ns=r.randrange(2**64),
                )
            case "Close" | "KeepAlive":
                return pb.SessionRequest(session_id=self.session())
            case "Lookup":
                return pb.LookupRequest(session_id=self.session(), hashes=self.hashes())
            case "Reserve":
                unnamed = r.random() < 0.3  # slots reserved ahead, with no hashes (or some)
                packed = self.hashes() if not unnamed or r.random() < 0.2 else b""
                n = len(packed) // 16
                metas = [r.randbytes(r.choice([0, 10, 5000])) for _ in range(r.choice([0, n, 1]))]
                return pb.ReserveRequest(
                    session_id=self.session(),
                    hashes=packed,
                    metas=metas,
                    call_id=r.randrange(2**64),
                    unnamed=r.choice([1, 5, 2**32 - 1]) if unnamed else 0,
                )
            case "Commit" | "Abort" | "Release":
                slots = [r.choice([*self.slots, r.randrange(2**32)]) for _ in range(r.randrange(9))]
                request = pb.SlotsRequest(session_id=self.session(), slots=slots)
                if name == "Commit" and r.random() < 0.3:  # naming slots reserved ahead
                    request.hashes = r.choice([r.randbytes(16 * len(slots)), self.hashes()])
                    request.metas.extend(
                        r.randbytes(r.choice([0, 9])) for _ in range(r.choice([0, len(slots), 1]))
                    )
                return request
            case "Acquire":
                return pb.AcquireRequest(
                    session_id=self.session(), hashes=self.hashes(), call_id=r.randrange(2**64)
                )
            case "Cancel":
                return pb.CancelRequest(session_id=self.session(), call_id=r.randrange(2**64))
            case "Put":
                return pb.PutRequest(
                    session_id=self.session(),
                    hash=r.choice([r.randbytes(16), r.randbytes(5)]),
                    meta=r.randbytes(r.choice([0, 20, 5000])),
                    data=r.randbytes(r.choice([BLOCK_BYTES, 17, 0])),
                )
            case "Get":
                return pb.GetRequest(session_id=self.session(), hashes=self.hashes())
            case "Pin":
                return pb.PinRequest(
                    session_id=self.session(),
                    hashes=self.hashes(),
                    seconds=r.choice([0.0, -1.0, 1.0, 1e12, float("nan"), float("inf")]),
                )
            case "SlotOps":
                session = r.choice(self.stream_sessions) if r.random() < 0.8 else self.session()
                session = session if r.random() < 0.95 else ""
                if r.random() < 0.05:  # more operations than one batch may carry
                    ops = [pb.SlotOp(op_id=i) for i in range(contract.MAX_SLOT_OPS + 1)]
                    return pb.SlotOpBatch(session_id=session, ops=ops)
                count = r.choice([0, 1, 3, 17])
                return pb.SlotOpBatch(
                    session_id=session, ops=[self.slot_op() for _ in range(count)]
                )
            case "Stats":
                return pb.StatsRequest()
            case "WatchEvents":
                return pb.WatchRequest(
                    layout_signature=r.choice([b"", SIGNATURE, r.randbytes(7)]),
                    replay=r.random() < 0.5,
                )
        raise AssertionError(name)

    def slot_op(self) -> pb.SlotOp:
        """One operation of a ``SlotOps`` batch: a random kind (or none), its own session
        field empty, the stream's, or another's."""
        kind = self.rng.choice(
            ["Reserve", "Commit", "Abort", "Acquire", "Release", "Cancel", "Lookup"]
        )
        request = self.message(kind)
        if self.rng.random() < 0.5:
            request.session_id = ""
        op = pb.SlotOp(op_id=self.rng.choice([0, 1, self.rng.randrange(2**64)]))
        if self.rng.random() < 0.95:
            getattr(op, kind.lower()).CopyFrom(request)
        return op

    def payload(self, name: str) -> bytes:
        raw = self.message(name).SerializeToString()
        kind = self.rng.random()
        if kind < 0.5:
            return raw
        if kind < 0.8 and raw:
            data = bytearray(raw)
            for _ in range(self.rng.randrange(1, 6)):
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)
            if self.rng.random() < 0.3:
                del data[self.rng.randrange(len(data)) :]
            return bytes(data) + self.rng.randbytes(self.rng.choice([0, 0, 3]))
        return self.rng.randbytes(self.rng.choice([1, 7, 64, 4096]))


_CODES = {code.value[0]: code for code in grpc.StatusCode}
STREAM_WAIT_S = 0.1
"""A watcher with nothing to hear waits for events: its deadline ends the call. Short, as
every hostile call the daemon accepts as a watch waits it out (0.5 s made this test 70 s)."""


def call(
    channel: grpc.Channel, method, payload: bytes, op_codes: dict | None = None
) -> grpc.StatusCode:
    """Sends raw bytes to ``method``; returns the status (reading at most one reply, or every
    reply of a ``SlotOps`` stream, whose operations' codes count into ``op_codes``)."""
    path = f"/kvtier.v1.KvTier/{method.name}"
    kwargs = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming and method.server_streaming:
            stream = channel.stream_stream(path, **kwargs)(iter([payload, payload]), timeout=10)
            for raw in stream:
                for result in pb.SlotResultBatch.FromString(raw).results:
                    code = _CODES[result.code]
                    if op_codes is not None:
                        op_codes[code] = op_codes.get(code, 0) + 1
        elif method.client_streaming:
            channel.stream_unary(path, **kwargs)(iter([payload, payload]), timeout=10)
        elif method.server_streaming:
            stream = channel.unary_stream(path, **kwargs)(payload, timeout=STREAM_WAIT_S)
            next(stream, None)
            stream.cancel()
        else:
            channel.unary_unary(path, **kwargs)(payload, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def channel_call(path: str, fuzzer: Fuzzer, op_codes: dict) -> grpc.StatusCode:
    """Sends one fuzzed ``SlotOps`` batch as a frame on a new slot channel connection (its
    length sometimes lying, or the frame cut short), ends the client's side, and reads every
    frame back; the channel's end status (OK when the daemon ended it without one)."""
    rng = fuzzer.rng
    raw = fuzzer.payload("SlotOps")
    size = len(raw)
    if rng.random() < 0.1:
        size = rng.choice([len(raw) + 5, 0, 2**32 - 1, rng.randrange(2**31)])
    frame = contract.FRAME.pack(size) + raw
    if rng.random() < 0.05:
        frame = frame[: rng.randrange(len(frame))]
    end = grpc.StatusCode.OK
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        # A daemon that ends the channel before reading all that was sent resets it.
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                data += chunk
    while len(data) >= contract.FRAME.size:
        (length,) = contract.FRAME.unpack_from(data)
        if len(data) < contract.FRAME.size + length:
            break  # cut off by the reset
        for result in pb.SlotResultBatch.FromString(data[4 : 4 + length]).results:
            code = _CODES[result.code]
            if not result.op_id:
                end = code
            op_codes[code] = op_codes.get(code, 0) + 1
        data = data[4 + length :]
    return end


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=256 * BLOCK_BYTES, disk_bytes=8192 * BLOCK_BYTES).start()
    yield d
    d.cleanup()


def test_ten_thousand_hostile_calls_leave_the_daemon_serving_and_others_intact(daemon):
    owner = daemon.client(client_name="owner")
    kept = [block_hash("kept", i) for i in range(32)]
    assert store(owner, kept) == kept
    rng = random.Random(SEED)
    channel, stub = daemon.stub()
    with channel:
        sessions = [open_session(stub).session_id for _ in range(3)]
        stream_sessions = [open_session(stub).session_id for _ in range(2)]
        call(channel, _METHODS[0], b"")  # the first calls warm the daemon's caches
        rss_before = rss_bytes(daemon.proc.pid)
        log_before = len(daemon.log.read_text().splitlines())
        fuzzer = Fuzzer(rng, sessions, stream_sessions)
        codes: dict[str, dict[grpc.StatusCode, int]] = {}
        op_codes: dict[grpc.StatusCode, int] = {}
        for _ in range(CALLS):
            method = rng.choice(_METHODS)
            code = call(channel, method, fuzzer.payload(method.name), op_codes)
            per_method = codes.setdefault(method.name, {})
            per_method[code] = per_method.get(code, 0) + 1
        path = os.fspath(contract.slot_channel_path(daemon.socket))
        channel_codes: dict[grpc.StatusCode, int] = {}
        for _ in range(CHANNEL_CALLS):
            code = channel_call(path, fuzzer, op_codes)
            channel_codes[code] = channel_codes.get(code, 0) + 1
        for session in stream_sessions:  # their slots back, for the owner's load below
            with contextlib.suppress(grpc.RpcError):
                stub.Close(pb.SessionRequest(session_id=session), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    unknown = {
        m: c[grpc.StatusCode.UNKNOWN] for m, c in codes.items() if grpc.StatusCode.UNKNOWN in c
    }
    assert not unknown, f"our own code failed: {unknown}\n{daemon.log.read_text()[-4000:]}"
    assert grpc.StatusCode.UNKNOWN not in op_codes, daemon.log.read_text()[-4000:]
    assert grpc.StatusCode.UNKNOWN not in channel_codes, daemon.log.read_text()[-4000:]
    assert sum(channel_codes.values()) == CHANNEL_CALLS
    assert op_codes.get(grpc.StatusCode.OK, 0) > 100, op_codes  # operations reached the tiers
    # A call that waits for nothing ran out of its 10 s only if the daemon hung on it.
    waiting = {m.name for m in _METHODS if m.server_streaming}
    hung = {
        m: c[grpc.StatusCode.DEADLINE_EXCEEDED]
        for m, c in codes.items()
        if m not in waiting and grpc.StatusCode.DEADLINE_EXCEEDED in c
    }
    assert not hung, f"calls that hung: {hung}"
    assert sum(sum(c.values()) for c in codes.values()) == CALLS
    assert set(codes) == {m.name for m in _METHODS}
    growth = rss_bytes(daemon.proc.pid) - rss_before
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth >> 20} MiB"
    lines = len(daemon.log.read_text().splitlines()) - log_before
    assert lines < LOG_LINES_LIMIT, f"{lines} log lines"
    assert load(owner, kept) == kept
    owner.close()
    assert daemon.stop() == 0
