"""gRPC's own log lines at a bounded rate: a local client cannot fill the disk through them."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.service.rpc import grpc_logs
from kvtier.service.rpc.grpc_logs import RepeatFilter

from daemonutil import BLOCK_BYTES, Daemon

GARBAGE = b"\xff\xff\xff"
"""No protobuf message decodes from this: a field tag whose varint never ends."""
CALLS = 200


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=16 * BLOCK_BYTES).start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def undecodable(channel: grpc.Channel, method: str, kind: str) -> grpc.StatusCode:
    """Sends ``GARBAGE`` to ``method``; returns the status it was answered with."""
    try:
        if kind == "unary":
            channel.unary_unary(method)(GARBAGE, timeout=30)
        elif kind == "stream":
            list(channel.unary_stream(method)(GARBAGE, timeout=30))
        else:
            list(channel.stream_stream(method)(iter([GARBAGE]), timeout=30))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_undecodable_requests_to_health_and_reflection_log_a_bounded_number_of_tracebacks(
    daemon,
):
    """grpcio logged a full traceback for each: 287 of them in a fuzz of 2,926 calls."""
    methods = [
        ("/grpc.health.v1.Health/Check", "unary"),
        ("/grpc.health.v1.Health/Watch", "stream"),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "bidi"),
    ]
    with grpc.insecure_channel(daemon.target) as channel:
        for method, kind in methods:
            codes = {undecodable(channel, method, kind) for _ in range(CALLS)}
            assert grpc.StatusCode.OK not in codes, (method, codes)
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    log = daemon.log.read_text()
    tracebacks = log.count("Traceback (most recent call last)")
    assert 1 <= tracebacks <= len(methods) * CALLS // 20, log[-4000:]
    assert "DecodeError" in log  # the first of each kind still says what happened


def test_repeats_are_counted_in_the_next_line_that_passes(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(grpc_logs.time, "monotonic", lambda: now[0])
    limiter = RepeatFilter(interval_s=10.0)
    logger = logging.getLogger("grpc.kvtier-test")

    def passes(msg: str, *args) -> str | None:
        """The line ``msg % args`` becomes, or None where it is held back."""
        record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, msg, args, None)
        return record.getMessage() if limiter.filter(record) else None

    assert passes("%d%% of calls from %s failed", 5, "a") == "5% of calls from a failed"
    assert passes("%d%% of calls from %s failed", 6, "b") is None
    assert passes("%d%% of calls from %s failed", 7, "c") is None
    assert passes("another kind") == "another kind"
    now[0] += 10.0
    assert passes("%d%% of calls from %s failed", 8, "d") == (
        "8% of calls from d failed (and 2 more like it not logged)"
    )
    assert passes("%d%% of calls from %s failed", 9, "e") is None
    now[0] += 10.0
    assert passes("%d%% of calls from %s failed", 1, "f") == (
        "1% of calls from f failed (and 1 more like it not logged)"
    )
