"""Slots of a session that ends without Close: back at once if the client is gone, else later."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from kvtier.proto.contract import PROTOCOL_VERSION, pid_namespace
from kvtier.service import daemon as daemon_module
from kvtier.service.config import DaemonConfig
from kvtier.service.daemon import Daemon
from kvtier.service.events import EventHub
from kvtier.service.liveness import process_gone
from kvtier.service.store import BlockStore
from kvtier.tiers.host.tier import ALREADY_STORED

from daemonutil import daemon_name

BLOCK = 4096


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_process_gone():
    ns = pid_namespace()
    assert not process_gone(os.getpid(), ns)
    assert process_gone(dead_pid(), ns)
    assert not process_gone(dead_pid(), ns + 1)  # another namespace: never taken for gone
    assert not process_gone(0, ns)


LAYOUT = b"s" * 16


@pytest.fixture
def daemon():
    cfg = DaemonConfig(name=daemon_name(), host_bytes=4 * BLOCK, disk_bytes=0)
    loop = asyncio.new_event_loop()
    d = Daemon(cfg, BlockStore(cfg, EventHub(loop)))
    yield d
    d.shutdown()
    loop.close()


def lose_session(d: Daemon, pid: int, block_hash: bytes) -> None:
    """Opens a session for ``pid``, reserves one slot, then loses the keep-alive stream."""
    opened = d.open(
        "c", LAYOUT, BLOCK, 16, PROTOCOL_VERSION, client_pid=pid, client_pid_ns=pid_namespace()
    )
    sid = opened.session
    d.attach(sid.session_id)
    assert d.reserve(sid.session_id, [block_hash])[0] >= 0
    d.detach(sid.session_id)


def test_lost_live_client_slots_stay_held_until_quarantine_ends(daemon, monkeypatch):
    gone, live = b"g" * 16, b"l" * 16
    lose_session(daemon, dead_pid(), gone)
    lose_session(daemon, os.getpid(), live)
    host = daemon.store.get(LAYOUT).host
    assert host.reserve([gone])[0] >= 0  # the dead client's slot came back at once
    assert host.reserve([live]) == [ALREADY_STORED]  # the live one's is still held
    assert daemon.stats()["layouts"][0]["quarantined_slots"] == 1  # and shown as held
    daemon.reap()
    assert host.reserve([live]) == [ALREADY_STORED]
    later = daemon_module.time.monotonic() + daemon_module.QUARANTINE_S + 1
    monkeypatch.setattr(daemon_module.time, "monotonic", lambda: later)
    daemon.reap()
    assert host.reserve([live])[0] >= 0
