"""The unix socket's relay: sessions bound to their connection, clients known by the kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.service.relay.unix import client_pid, private_dir_of

from daemonutil import BLOCK_BYTES, Daemon, block_hash, open_session, relay_pids, wait_until


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=16 * BLOCK_BYTES).start()
    yield d
    assert d.stop() == 0, d.log.read_text()
    d.cleanup()


def code(fn, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=10)
    return info.value.code()


def test_a_session_id_is_useless_from_another_unix_connection(daemon):
    """gRPC names no unix peer, so a session id was a bearer token on the unix socket."""
    mine, stub = daemon.stub()
    # its own subchannel pool: a connection of its own, not one shared with ``mine``
    options = [*contract.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    other = grpc.insecure_channel(daemon.target, options=options)
    thief = pb_grpc.KvTierStub(other)
    with mine, other:
        session = open_session(stub).session_id
        lookup = pb.LookupRequest(session_id=session, hashes=block_hash("leak", 0))
        assert code(thief.Lookup, lookup) == grpc.StatusCode.PERMISSION_DENIED
        reserve = pb.ReserveRequest(session_id=session, hashes=block_hash("leak", 1))
        assert code(thief.Reserve, reserve) == grpc.StatusCode.PERMISSION_DENIED
        assert code(thief.Close, pb.SessionRequest(session_id=session)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        stub.Lookup(lookup, timeout=10)  # its own connection still may
        stub.Close(pb.SessionRequest(session_id=session), timeout=10)


CLIENT = """
import os, sys, threading, time
import grpc
from kvtier.proto import contract, kvtier_pb2 as pb, kvtier_pb2_grpc as pb_grpc
channel = grpc.insecure_channel(sys.argv[1], options=contract.CHANNEL_OPTIONS)
stub = pb_grpc.KvTierStub(channel)
opened = stub.Open(pb.OpenRequest(
    client_name="elsewhere", layout_signature=bytes(range(16)), block_bytes=int(sys.argv[2]),
    block_tokens=16, protocol_version=contract.PROTOCOL_VERSION,
    client_pid=os.getpid(), client_pid_ns=1,  # as a client in another pid namespace says
), timeout=10)
stream = stub.KeepAlive(pb.SessionRequest(session_id=opened.session_id))
threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()
reply = stub.Reserve(pb.ReserveRequest(session_id=opened.session_id, hashes=bytes(16)), timeout=10)
assert reply.slots[0] >= 0
print("ready", flush=True)
time.sleep(600)
"""


def test_slots_of_a_killed_client_in_another_pid_namespace_come_back_at_once(daemon):
    """The daemon took a client's word for its pid: one in another pid namespace could never
    be found gone, and its slots sat out the whole quarantine. The kernel's pid, in the
    daemon's own namespace, comes with each connection through the relay."""
    client = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CLIENT), daemon.target, str(BLOCK_BYTES)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "ready"
        assert daemon.stats().reserved_slots == 1
        os.kill(client.pid, signal.SIGKILL)
        client.wait(timeout=30)
        wait_until(lambda: daemon.stats().sessions == 0, "the killed client's session ended")
        stats = daemon.stats()
        assert stats.quarantined_slots == 0 and stats.reserved_slots == 0
    finally:
        if client.poll() is None:
            client.kill()
    assert f"(pid {client.pid})" in daemon.log.read_text()


def test_the_relay_leaves_nothing_behind(daemon):
    private = private_dir_of(daemon.socket)
    channel, stub = daemon.stub()
    with channel:
        open_session(stub)
        assert any(p.name.startswith("c") for p in private.iterdir())  # this connection's address
    wait_until(
        lambda: not any(p.name.startswith("c") for p in private.iterdir()),
        "the closed connection's address removed",
    )
    assert daemon.stop() == 0, daemon.log.read_text()
    assert not private.exists() and not daemon.socket.exists()


def test_a_relay_that_dies_is_started_again_and_dies_with_the_daemon():
    daemon = Daemon(host_bytes=16 * BLOCK_BYTES).start()
    try:
        (first,) = relay_pids(daemon)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: relay_pids(daemon) not in ([], [first]), "a new relay")
        channel, stub = daemon.stub()
        with channel:
            assert open_session(stub, wait_for_ready=True).session_id
        assert "relay exited" in daemon.log.read_text()
        (second,) = relay_pids(daemon)
        daemon.kill(signal.SIGKILL)
        wait_until(lambda: not relay_pids(daemon), "the relay gone with its daemon")
        assert second != first
    finally:
        daemon.cleanup()


def test_a_relative_socket_path_still_binds_every_session(monkeypatch, tmp_path):
    """``--socket k.sock`` gave relative relay addresses, which no session was bound to."""
    monkeypatch.chdir(tmp_path)
    private = private_dir_of(Path("k.sock"))
    assert private == tmp_path / ".k.sock.d"
    assert client_pid(f"unix:{private}/c17.3-4242", private) == 4242
    assert client_pid("unix:", private) is None
    assert client_pid(f"unix:{private}/grpc.sock", private) is None
    assert client_pid(f"unix:{private}/c3-", private) is None
