"""``SlotOps``: one session's slot operations over one stream keep every guarantee their unary
calls give. Each operation is refused exactly as its own call is; the stream serves only the
session it was opened for, and only on that session's connection; a lost session's slots stay
fenced whichever way its operations came."""

from __future__ import annotations

import grpc
import pytest

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

from daemonutil import BLOCK_BYTES, Daemon, block_hash, open_session, wait_until

HOST_SLOTS = 4
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_FIELDS = {
    "Reserve": "reserve",
    "Commit": "commit",
    "Abort": "abort",
    "Acquire": "acquire",
    "Release": "release",
    "Cancel": "cancel",
}


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=HOST_SLOTS * BLOCK_BYTES, disk_bytes=0, lease_s=2.0).start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def op(method: str, request, op_id: int = 1) -> pb.SlotOp:
    return pb.SlotOp(op_id=op_id, **{_FIELDS[method]: request})


def stream(stub, session: str, *batches: list[pb.SlotOp]) -> dict[int, pb.SlotResult]:
    """Sends ``batches`` on one stream for ``session``; every result, by op id."""
    requests = [pb.SlotOpBatch(session_id=session, ops=batches[0])]
    requests += [pb.SlotOpBatch(ops=ops) for ops in batches[1:]]
    return {r.op_id: r for b in stub.SlotOps(iter(requests), timeout=30) for r in b.results}


def over_stream(stub, session: str, method: str, request):
    """One operation on a stream of its own: its reply, or its status as ``grpc.StatusCode``."""
    (result,) = stream(stub, session, [op(method, request)]).values()
    if result.code:
        return _CODES[result.code]
    return getattr(result, result.WhichOneof("result"))


def unary(stub, method: str, request):
    try:
        return getattr(stub, method)(request, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()


def stream_status(stub, batches: list[pb.SlotOpBatch]) -> grpc.StatusCode:
    try:
        for _ in stub.SlotOps(iter(batches), timeout=30):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_operations_over_a_stream_answer_and_refuse_as_their_calls_do(daemon):
    channel, stub = daemon.stub()
    with channel:
        a, b = (open_session(stub).session_id for _ in range(2))
        hashes = block_hash("a", 0) + block_hash("a", 1)
        slots = list(over_stream(stub, a, "Reserve", pb.ReserveRequest(hashes=hashes)).slots)
        assert all(s >= 0 for s in slots)
        (theirs,) = unary(stub, "Reserve", pb.ReserveRequest(session_id=b, hashes=bytes(16))).slots
        refusals = [  # (method, request): neither path may take these
            ("Commit", pb.SlotsRequest(session_id=a, slots=[theirs])),  # another session's
            ("Abort", pb.SlotsRequest(session_id=a, slots=[theirs])),
            ("Release", pb.SlotsRequest(session_id=a, slots=slots)),  # reserved, not acquired
            ("Commit", pb.SlotsRequest(session_id=a, slots=[HOST_SLOTS + 7])),  # out of range
            ("Commit", pb.SlotsRequest(session_id=a, slots=[0] * (contract.MAX_HASHES + 1))),
            ("Reserve", pb.ReserveRequest(session_id=a, hashes=bytes(17))),
            ("Acquire", pb.AcquireRequest(session_id=a, hashes=bytes(16 * 65537))),
            ("Commit", pb.SlotsRequest(session_id=b, slots=[theirs])),  # names another session
        ]
        for method, request in refusals:
            via_stream = over_stream(stub, a, method, request)
            expected = (
                unary(stub, method, request)
                if request.session_id == a
                else (grpc.StatusCode.PERMISSION_DENIED)
            )
            assert isinstance(via_stream, grpc.StatusCode), (method, request)
            assert via_stream == expected, (method, via_stream, expected)
        # a call that arrives after its own Cancel does nothing, over the stream as unary
        assert over_stream(stub, a, "Cancel", pb.CancelRequest(call_id=9)).returned == 0
        late = pb.ReserveRequest(hashes=block_hash("a", 2), call_id=9)
        assert over_stream(stub, a, "Reserve", late) == grpc.StatusCode.CANCELLED

        # one stream, several batches: commit, then acquire and release what it stored
        results = stream(
            stub,
            a,
            [op("Commit", pb.SlotsRequest(slots=slots), 1)],
            [op("Acquire", pb.AcquireRequest(hashes=hashes), 2)],
        )
        assert [r.code for r in results.values()] == [0, 0]
        assert list(results[2].acquire.slots) == slots
        assert over_stream(stub, a, "Release", pb.SlotsRequest(slots=slots)).count == 2
        assert unary(stub, "Commit", pb.SlotsRequest(session_id=b, slots=[theirs])).count == 1
        stats = daemon.stats()
        assert (stats.reserved_slots, stats.acquired_slots) == (0, 0)


def test_a_stream_serves_one_session_on_its_own_connection(daemon):
    mine, stub = daemon.stub()
    options = [*contract.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    other = grpc.insecure_channel(daemon.target, options=options)
    thief = pb_grpc.KvTierStub(other)
    reserve = op("Reserve", pb.ReserveRequest(hashes=block_hash("leak", 0)))
    with mine, other:
        a, b = (open_session(stub).session_id for _ in range(2))
        assert stream_status(thief, [pb.SlotOpBatch(session_id=a, ops=[reserve])]) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert stream_status(stub, [pb.SlotOpBatch(session_id="nope", ops=[reserve])]) == (
            grpc.StatusCode.NOT_FOUND
        )
        assert stream_status(stub, [pb.SlotOpBatch(ops=[reserve])]) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        switch = [pb.SlotOpBatch(session_id=a, ops=[]), pb.SlotOpBatch(session_id=b, ops=[])]
        assert stream_status(stub, switch) == grpc.StatusCode.PERMISSION_DENIED
        many = [pb.SlotOp(op_id=i) for i in range(contract.MAX_SLOT_OPS + 1)]
        assert stream_status(stub, [pb.SlotOpBatch(session_id=a, ops=many)]) == (
            grpc.StatusCode.OUT_OF_RANGE
        )
        # an operation of no kind, and garbage ids, are answered one by one
        results = stream(stub, a, [pb.SlotOp(op_id=2**64 - 1), pb.SlotOp(op_id=0)])
        assert {i: _CODES[r.code] for i, r in results.items()} == {
            2**64 - 1: grpc.StatusCode.INVALID_ARGUMENT,
            0: grpc.StatusCode.INVALID_ARGUMENT,
        }
        assert daemon.stats().reserved_slots == 0


def test_a_lost_sessions_slot_reserved_over_a_stream_stays_fenced(daemon):
    channel, stub = daemon.stub()
    with channel:
        a = open_session(stub).session_id
        keepalive = stub.KeepAlive(pb.SessionRequest(session_id=a))
        next(keepalive)
        (fenced,) = over_stream(stub, a, "Reserve", pb.ReserveRequest(hashes=bytes(16))).slots
        keepalive.cancel()  # A's client lost its stream with a store in flight
        wait_until(lambda: daemon.stats().quarantined_slots == 1, "A's slot to be fenced")
        commit = pb.SlotsRequest(session_id=a, slots=[fenced])  # the late commit is refused
        late = [pb.SlotOpBatch(session_id=a, ops=[op("Commit", commit)])]
        assert stream_status(stub, late) == unary(stub, "Commit", commit)
        assert unary(stub, "Commit", commit) == grpc.StatusCode.NOT_FOUND
        others = [open_session(stub).session_id for _ in range(2)]  # a share each
        taken = reserve_all(stub, others)
        assert fenced not in taken
        assert len(taken) == HOST_SLOTS - 1
        # A's client reopens naming the lost session: the fence lifts
        reopened = stub.Open(
            pb.OpenRequest(
                client_name="a",
                layout_signature=bytes(range(16)),
                block_bytes=BLOCK_BYTES,
                block_tokens=16,
                protocol_version=contract.PROTOCOL_VERSION,
                lost_sessions=[a],
            ),
            timeout=10,
        )
        assert daemon.stats().quarantined_slots == 0
        assert len(reserve_all(stub, others)) == HOST_SLOTS
        stub.Close(pb.SessionRequest(session_id=reopened.session_id), timeout=10)


def reserve_all(stub, sessions: list[str]) -> list[int]:
    """Every slot ``sessions`` can reserve together (over their streams), then aborted."""
    taken = {}
    for session in sessions:
        hashes = b"".join(block_hash(session, i) for i in range(HOST_SLOTS))
        reply = over_stream(stub, session, "Reserve", pb.ReserveRequest(hashes=hashes))
        taken[session] = [s for s in reply.slots if s >= 0]
    for session, mine in taken.items():
        assert over_stream(stub, session, "Abort", pb.SlotsRequest(slots=mine)).count == len(mine)
    return [s for mine in taken.values() for s in mine]
