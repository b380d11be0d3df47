"""Every RPC of a real daemon, from several client processes at once, and its refusals."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.proto.contract import MIN_BLOCK_BYTES
from kvtier.service.stats import metrics
from kvtier.tiers.lower import MAX_META_BYTES

from daemonutil import (
    BLOCK_BYTES,
    SIGNATURE,
    Daemon,
    block_hash,
    content,
    free_port,
    load,
    open_session,
    store,
)

WORKERS = 3
PER_WORKER = 12
SHARED = 6


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(host_bytes=128 * BLOCK_BYTES).start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def worker(target: str, index: int, results) -> None:
    """One engine process: stores its own and some shared blocks, reads them all back."""
    from kvtier.connector.client.daemon_client import DaemonClient

    from daemonutil import SIGNATURE

    client = DaemonClient(
        SIGNATURE, BLOCK_BYTES, block_tokens=16, target=target, client_name=f"worker-{index}"
    )
    try:
        assert client.wait_connected(60)
        own = [block_hash(f"w{index}", i) for i in range(PER_WORKER)]
        shared = [block_hash("shared", i) for i in range(SHARED)]
        metas = [b"engine-block-%d" % i for i in range(PER_WORKER)]
        slots = client.reserve(own, metas)
        assert all(s >= 0 for s in slots), slots
        for h, s in zip(own, slots, strict=True):
            client.slab[s].numpy()[:] = content(h)
        assert client.commit(slots)
        stored_shared = store(client, shared)
        hits = client.lookup([*own, block_hash("missing", index)])
        assert hits.total == PER_WORKER, hits
        assert load(client, own) == own
        assert client.lookup(shared).total == SHARED
        # abort gives the hash back unstored
        probe = block_hash(f"aborted{index}", 0)
        (slot,) = client.reserve([probe])
        client.abort([slot])
        assert client.lookup([probe]).total == 0
        # bytes through gRPC
        put = [block_hash(f"put{index}", i) for i in range(3)]
        assert client.tools.put_blocks(put, [content(h).tobytes() for h in put]) == 3
        got = client.tools.get_blocks(put)
        assert [np.frombuffer(g, np.uint8).tolist() for g in got] == [
            content(h).tolist() for h in put
        ]
        assert client.tools.stats().sessions >= 1
        results.put((index, len(stored_shared), client.failures))
    except BaseException as exc:
        results.put((index, repr(exc), -1))
        raise
    finally:
        client.close()


async def watch(target: str, want: int) -> list[pb.BlockEvent]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KvTierStub(channel)
        events: list[pb.BlockEvent] = []
        async for batch in stub.WatchEvents(pb.WatchRequest()):
            events.extend(e for e in batch.events if e.tier == "host")
            if len(events) >= want:
                return events
    return events


@pytest.mark.asyncio
async def test_every_rpc_from_several_processes(daemon):
    # stored events from the host tier: every worker's own, the shared ones once, the puts
    want = WORKERS * PER_WORKER + SHARED + WORKERS * 3
    watcher = asyncio.create_task(watch(daemon.target, want))
    await asyncio.sleep(0.2)  # let the subscription register before the stores begin
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(daemon.target, i, results), daemon=True)
        for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    outcomes = [await asyncio.to_thread(results.get, timeout=90) for _ in procs]
    for p in procs:
        await asyncio.to_thread(p.join, 30)
        assert p.exitcode == 0, outcomes
    assert sorted(o[0] for o in outcomes) == list(range(WORKERS))
    assert sum(o[1] for o in outcomes) == SHARED, outcomes  # each shared block stored once
    assert all(o[2] == 0 for o in outcomes), outcomes  # no client saw daemon trouble
    events = await asyncio.wait_for(watcher, 60)
    host_stored = [e for e in events if e.kind == pb.BlockEvent.STORED and e.tier == "host"]
    by_hash = {e.hash: e for e in host_stored}
    assert by_hash[block_hash("w1", 3)].meta == b"engine-block-3"
    assert by_hash[block_hash("shared", 0)].meta == b""
    assert by_hash[block_hash("w1", 3)].layout_signature == SIGNATURE
    stats = daemon.stats()
    assert stats.sessions == 0 and stats.reserved_slots == 0 and stats.acquired_slots == 0
    host = next(t for t in stats.tiers if t.tier == "host")
    assert host.hit_tokens > 0 and host.query_tokens >= host.hit_tokens


def call(fn, request, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=10, **kwargs)
    return info.value.code()


def test_malformed_input_gets_its_status_and_daemon_keeps_serving(daemon):
    channel, stub = daemon.stub()
    with channel:
        mine = open_session(stub).session_id
        other = open_session(stub).session_id
        bad_hash = pb.LookupRequest(session_id=mine, hashes=b"x" * 15)
        assert call(stub.Lookup, bad_hash) == grpc.StatusCode.INVALID_ARGUMENT
        huge = pb.LookupRequest(session_id=mine, hashes=bytes(16 * (contract.MAX_HASHES + 1)))
        assert call(stub.Lookup, huge) == grpc.StatusCode.OUT_OF_RANGE
        unknown = pb.LookupRequest(session_id="nope", hashes=bytes(16))
        assert call(stub.Lookup, unknown) == grpc.StatusCode.NOT_FOUND
        reply = stub.Reserve(
            pb.ReserveRequest(session_id=other, hashes=block_hash("foreign", 0)), timeout=10
        )
        (theirs,) = reply.slots
        assert theirs >= 0
        for method in (stub.Commit, stub.Abort, stub.Release):
            steal = pb.SlotsRequest(session_id=mine, slots=[theirs])
            assert call(method, steal) == grpc.StatusCode.PERMISSION_DENIED
        out_of_range = pb.SlotsRequest(session_id=mine, slots=[10**6])
        assert call(stub.Commit, out_of_range) == grpc.StatusCode.INVALID_ARGUMENT
        twice = pb.ReserveRequest(session_id=mine, hashes=block_hash("t", 0) * 2)
        assert call(stub.Reserve, twice) == grpc.StatusCode.INVALID_ARGUMENT
        metas = pb.ReserveRequest(session_id=mine, hashes=block_hash("t", 1), metas=[b"a", b"b"])
        assert call(stub.Reserve, metas) == grpc.StatusCode.INVALID_ARGUMENT
        big_meta = pb.ReserveRequest(
            session_id=mine, hashes=block_hash("t", 1), metas=[bytes(MAX_META_BYTES + 1)]
        )
        assert call(stub.Reserve, big_meta) == grpc.StatusCode.INVALID_ARGUMENT
        wrong_size = pb.PutRequest(session_id=mine, hash=block_hash("p", 0), data=b"x")
        assert call(stub.Put, iter([wrong_size])) == grpc.StatusCode.INVALID_ARGUMENT
        # another layout gets its own arena; the same layout with another block size does not
        other_layout = b"\xff" * 16
        second = open_session(stub, signature=other_layout, block_bytes=2 * BLOCK_BYTES)
        first = open_session(stub)
        assert second.arena_path != first.arena_path and second.slot_bytes == 2 * BLOCK_BYTES
        with pytest.raises(grpc.RpcError) as info:
            open_session(stub, signature=other_layout)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as info:
            open_session(stub, signature=b"\xee" * 16, block_bytes=MIN_BLOCK_BYTES - 1)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for opened in (first, second):
            stub.Close(pb.SessionRequest(session_id=opened.session_id), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            open_session(stub, signature=b"short")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the owner can still commit its slot, and the daemon still answers
        stub.Abort(pb.SlotsRequest(session_id=other, slots=[theirs]), timeout=10)
        stub.Close(pb.SessionRequest(session_id=other), timeout=10)
        assert call(stub.Close, pb.SessionRequest(session_id=other)) == grpc.StatusCode.NOT_FOUND
        ok = stub.Lookup(pb.LookupRequest(session_id=mine, hashes=bytes(16)), timeout=10)
        assert ok.host == 0
        stub.Close(pb.SessionRequest(session_id=mine), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_and_stats_endpoints(daemon):
    with daemon.client(client_name="metrics") as client:  # the layout exists from here on
        assert client.lookup([bytes(16)]).total == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.stats_port}/metrics", timeout=10) as r:
        text = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/plain")
    layout = SIGNATURE.hex()
    assert f'kvtier_hit_tokens_total{{layout="{layout}",tier="host"}}' in text
    assert "kvtier_rpc_seconds_bucket" in text
    assert f'kvtier_capacity_blocks{{layout="{layout}",tier="host"}} 128.0' in text
    assert f'kvtier_writing_behind_blocks{{layout="{layout}"}}' in text
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.stats_port}/stats", timeout=10) as r:
        stats = json.loads(r.read())
    mine = [t["tier"] for t in stats["tiers"] if t["layout"] == layout]
    assert mine == ["host", "disk"]
    assert {"layout": layout, "disk": "ok"}.items() <= stats["layouts"][0].items()


def test_every_metric_the_dashboard_charts_is_exported(daemon):
    """A panel whose query names a metric the daemon does not export draws nothing and warns
    nobody: every kvtier metric the Grafana dashboard queries is on /metrics."""
    dashboard = json.loads(
        (Path(metrics.__file__).parent / "grafana" / "kvtier-dashboard.json").read_text()
    )
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"kvtier_\w+", target["expr"])
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.stats_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    exported: set[str] = set()
    for family in text_string_to_metric_families(text):
        exported |= {family.name, *(sample.name for sample in family.samples)}
        if family.type == "counter":
            exported.add(f"{family.name}_total")
        if family.type == "histogram":
            exported |= {f"{family.name}{part}" for part in ("_bucket", "_count", "_sum")}
    assert "kvtier_lookup_holds_missed_total" in queried
    assert queried <= exported, sorted(queried - exported)


def test_stats_command_prints_the_table(daemon):
    cmd = [
        sys.executable,
        "-c",
        "import sys; from kvtier.service.stats import cli as stats_cli; "
        "import argparse; p = argparse.ArgumentParser(); stats_cli.add_arguments(p); "
        "sys.exit(stats_cli.run(p.parse_args(sys.argv[1:])))",
        "--target",
        daemon.target,
    ]
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    header = table.splitlines()[0].split()
    assert header[header.index("tier") : header.index("tier") + 5] == [
        "tier",
        "query",
        "tok",
        "hit",
        "tok",
    ]
    assert any(" host " in f" {line} " for line in table.splitlines()[1:])
    assert "hit rate" in table
    as_json = subprocess.run(
        [*cmd, "--json"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert '"tier": "disk"' in as_json


def test_reflection_lists_the_service(daemon):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel, _ = daemon.stub()
    with channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert "kvtier.v1.KvTier" in names and "grpc.health.v1.Health" in names


def test_tcp_requires_the_token():
    d = Daemon(tcp_port=free_port(), token="s3cret", stats_port=-1)
    try:
        d.start()
        target = f"127.0.0.1:{d.tcp_port}"
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.KvTierStub(channel)
            assert call(stub.Stats, pb.StatsRequest()) == grpc.StatusCode.UNAUTHENTICATED
            wrong = contract.bearer("guess")
            assert call(stub.Stats, pb.StatsRequest(), metadata=wrong) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            with pytest.raises(grpc.RpcError) as info:
                open_session(stub)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = contract.bearer("s3cret")
            assert stub.Stats(pb.StatsRequest(), timeout=10, metadata=good).sessions == 0
            with pytest.raises(grpc.RpcError) as info:
                list(stub.SlotOps(iter([pb.SlotOpBatch(session_id="x")]), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = d.client(token="s3cret", client_name="tcp")
        assert store(client, [block_hash("tcp", 0)]) == [block_hash("tcp", 0)]
        client.close()
        tcp = DaemonClient(SIGNATURE, BLOCK_BYTES, target=target, token="s3cret")
        assert tcp.wait_connected(60), d.log.read_text()
        assert not tcp.slot_calls.streaming  # slot operations over TCP are unary calls
        assert store(tcp, [block_hash("tcp", 1)]) == [block_hash("tcp", 1)]
        tcp.close()
        assert d.stop() == 0
    finally:
        d.cleanup()
