"""Slots of a session that ends without Close: back at once if the client is gone, else fenced
until the client reopens naming the session or its process has finished exiting — never
after a timer while it lives."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import textwrap

import pytest

from kvtier.proto.contract import PROTOCOL_VERSION, pid_namespace
from kvtier.service import fence as fence_module
from kvtier.service.daemon import Daemon
from kvtier.service.fence import Fence
from kvtier.service.liveness import process_gone, task_state
from kvtier.service.sessions import Leftovers
from kvtier.service.tunables import TUNABLES
from kvtier.tiers.lower import ALREADY_STORED

from daemonutil import in_process_daemon, wait_until

BLOCK = 4096
LAYOUT = b"s" * 16
PF_EXITING = 0x4
SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine())
"""The raw ``exit`` system call, which ends the calling thread only."""


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stat_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read()


def flags_of(stat: str) -> int:
    return int(stat[stat.rindex(")") + 2 :].split()[6])


def test_process_gone():
    ns = pid_namespace()
    assert not process_gone(os.getpid(), ns)
    assert process_gone(dead_pid(), ns)
    assert not process_gone(dead_pid(), ns + 1)  # another namespace: never taken for gone
    assert not process_gone(0, ns)


def test_a_zombie_is_gone_whatever_its_name():
    """A zombie has released its memory and files; its state is read past a command name
    that looks like the fields after it."""
    name = b"x) R 1 (y"
    code = f"import ctypes; ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0)"  # PR_SET_NAME
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_until(lambda: task_state(stat_of(child.pid)) == "Z", "the child to exit")
        assert name.decode() in stat_of(child.pid)
        assert process_gone(child.pid, pid_namespace())
    finally:
        child.wait()


@pytest.mark.skipif(SYS_EXIT is None, reason=f"no exit syscall number for {platform.machine()}")
def test_a_process_whose_main_thread_exited_is_not_gone():
    """Defect: a process only exiting (``PF_EXITING``, its main thread a zombie) was taken for
    gone, while another of its threads can still queue a copy into the arena."""
    code = textwrap.dedent(
        f"""
        import ctypes, threading, time
        def keep_running():
            while True:
                time.sleep(0.01)
        threading.Thread(target=keep_running).start()
        print("ready", flush=True)
        ctypes.CDLL(None).syscall({SYS_EXIT}, 0)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        wait_until(lambda: task_state(stat_of(child.pid)) == "Z", "the main thread to exit")
        assert flags_of(stat_of(child.pid)) & PF_EXITING
        assert not process_gone(child.pid, pid_namespace())
        child.kill()
        wait_until(lambda: process_gone(child.pid, pid_namespace()), "the process to be gone")
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


# ---------------------------------------------------------------- the daemon's fence


@pytest.fixture
def daemon():
    with in_process_daemon(host_bytes=4 * BLOCK) as d:
        yield d


def lose_session(d: Daemon, pid: int, block_hash: bytes) -> str:
    """Opens a session for ``pid``, reserves one slot, then loses the keep-alive stream;
    returns the session's id."""
    opened = d.open(
        "c", LAYOUT, BLOCK, 16, PROTOCOL_VERSION, client_pid=pid, client_pid_ns=pid_namespace()
    )
    sid = opened.session.session_id
    d.attach(sid)
    assert d.reserve(sid, [block_hash])[0] >= 0
    d.detach(sid)
    return sid


def reopen(d: Daemon, lost: list[str]) -> None:
    d.open(
        "c",
        LAYOUT,
        BLOCK,
        16,
        PROTOCOL_VERSION,
        client_pid=os.getpid(),
        client_pid_ns=pid_namespace(),
        lost_sessions=lost,
    )


def test_a_lost_live_clients_slots_stay_fenced_however_long(daemon, monkeypatch):
    """Defect: the slots of a live client that lost its stream were reused after 10 s, under
    a copy of its that an engine paused longer could still finish."""
    gone, live = b"g" * 16, b"l" * 16
    lose_session(daemon, dead_pid(), gone)
    lose_session(daemon, os.getpid(), live)
    host = daemon.store.get(LAYOUT).host
    assert host.reserve([gone])[0] >= 0  # the dead client's slot came back at once
    assert host.reserve([live]) == [ALREADY_STORED]  # the live one's is fenced
    assert daemon.stats()["layouts"][0]["quarantined_slots"] == 1  # and shown as held
    hour_later = fence_module.time.monotonic() + 3600
    monkeypatch.setattr(fence_module.time, "monotonic", lambda: hour_later)
    daemon.reap()
    assert host.reserve([live]) == [ALREADY_STORED]
    assert daemon.stats()["quarantined_slots"] == 1


def test_a_reopen_naming_the_lost_session_frees_its_slots(daemon):
    sid = lose_session(daemon, os.getpid(), b"l" * 16)
    reopen(daemon, ["not-a-session", sid])
    assert daemon.stats()["quarantined_slots"] == 0
    assert daemon.store.get(LAYOUT).host.reserve([b"l" * 16])[0] >= 0


def test_a_reopen_before_the_daemon_saw_the_loss_frees_the_slots_when_it_does(daemon):
    """The client may reopen before the daemon has noticed its old stream end."""
    opened = daemon.open(
        "c",
        LAYOUT,
        BLOCK,
        16,
        PROTOCOL_VERSION,
        client_pid=os.getpid(),
        client_pid_ns=pid_namespace(),
    )
    sid = opened.session.session_id
    daemon.attach(sid)
    assert daemon.reserve(sid, [b"l" * 16])[0] >= 0
    reopen(daemon, [sid])
    daemon.detach(sid)
    assert daemon.stats()["quarantined_slots"] == 0
    assert daemon.store.get(LAYOUT).host.reserve([b"l" * 16])[0] >= 0


def test_a_client_that_finishes_exiting_gets_its_slots_back_at_once(daemon):
    """Its slots come back when the kernel says it has exited, not at a later reap."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        lose_session(daemon, child.pid, b"c" * 16)
        daemon.reap()
        assert daemon.stats()["quarantined_slots"] == 1  # alive: fenced
        child.send_signal(signal.SIGKILL)
        wait_until(lambda: daemon.stats()["quarantined_slots"] == 0, "the slot to come back")
        assert daemon.store.get(LAYOUT).host.reserve([b"c" * 16])[0] >= 0
    finally:
        child.kill()
        child.wait()


def test_an_unverifiable_clients_slots_come_back_after_a_long_bound():
    """A client whose process the daemon cannot see (over TCP): a bound on the leak."""
    now = [0.0]
    back: list[Leftovers] = []
    fence = Fence(back.append, clock=lambda: now[0])
    fence.hold(Leftovers(LAYOUT, [3], [], session_id="tcp"))
    now[0] = TUNABLES.unverifiable_hold_s / 2
    assert fence.sweep() == 0 and not back
    now[0] = TUNABLES.unverifiable_hold_s
    assert fence.sweep() == 1 and back[0].reserved == [3]
    fence.drain()


def test_the_slots_a_lookup_held_come_back_at_once_from_a_fenced_session():
    back: list[Leftovers] = []
    fence = Fence(back.append)
    fence.hold(
        Leftovers(
            LAYOUT,
            [1],
            [2],
            session_id="s",
            client_pid=os.getpid(),
            client_pid_ns=pid_namespace(),
            held=[5],
        )
    )
    assert [b.held for b in back] == [[5]]
    assert [(b.reserved, b.acquired) for b in fence.held()] == [([1], [2])]
    fence.release(["s"])
    assert [(b.reserved, b.acquired) for b in back[1:]] == [([1], [2])]
    assert fence.drain() == []
