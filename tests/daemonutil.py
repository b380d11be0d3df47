"""Daemon test helpers: a real ``kvtier serve`` process, raw stubs and a client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.service import daemon as daemon_module
from kvtier.service.arena import SHM_DIR
from kvtier.service.config import DaemonConfig
from kvtier.service.events import EventHub
from kvtier.service.relay.unix import private_dir_of
from kvtier.service.store import BlockStore

RUN = os.environ.setdefault("KVTIER_TEST_RUN", uuid.uuid4().hex[:8])
"""This pytest session's mark. Every process it starts inherits it (an engine's, a script's):
a daemon one of them starts is this session's too, so the check at the session's end sees
whatever that daemon left."""
NAME_PREFIX = f"test-{RUN}-"
"""Every daemon this pytest session starts, in a process or not, is named under this prefix,
so its arenas are ``/dev/shm/kvtier-test-<run>-…``; other sessions on the machine have
their own, and ``leftovers`` never sees theirs."""
ROOT_PREFIX = f"kvd-{RUN}-"
"""Every daemon's directory (socket, log, disk tier) is ``/tmp/kvd-<run>-…``."""
SIGNATURE = bytes(range(16))
BLOCK_BYTES = 8192
START_TIMEOUT_S = 60
DAEMON_PYTHON = os.environ.get("KVTIER_TEST_DAEMON_PYTHON") or sys.executable
"""The interpreter daemons run under: the tests' own, or another environment's with kvtier in
it (``tests/run.sh`` runs the vLLM step's daemons under the main environment, whose CPU build
of torch imports in half the time of vLLM's CUDA build, at every daemon start)."""
SET_NOFILE = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])"
)
"""``python -c SET_NOFILE SOFT HARD ARGS…``: runs ``python ARGS…`` under that descriptor limit."""


def daemon_name() -> str:
    """A fresh daemon name under this session's ``NAME_PREFIX``."""
    return f"{NAME_PREFIX}{uuid.uuid4().hex[:12]}"


def arenas_of(name: str) -> list[Path]:
    """The shared-memory arenas of daemon ``name``: one per layout, ``kvtier-<name>-<layout>``."""
    return sorted(SHM_DIR.glob(f"kvtier-{name}-*"))


def leftovers(grace_s: float = 10.0) -> list[str]:
    """What this session's daemons left on the machine: processes (a daemon, its relay, a
    client of it) still running after ``grace_s``, arenas and directories; each is killed or
    removed."""
    deadline = time.monotonic() + grace_s
    while (running := session_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)  # a relay whose daemon was just killed is on its way out
    found = [f"pid {pid}: {cmdline}" for pid, cmdline in running]
    for pid, _ in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for path in SHM_DIR.glob(f"kvtier-{NAME_PREFIX}*"):
        found.append(str(path))
        path.unlink(missing_ok=True)
    for root in Path("/tmp").glob(f"{ROOT_PREFIX}*"):
        found.append(str(root))
        shutil.rmtree(root, ignore_errors=True)
    return found


def session_processes() -> list[tuple[int, str]]:
    """Processes whose command line names this session's daemons or their directories."""
    return processes_naming(NAME_PREFIX, f"/tmp/{ROOT_PREFIX}")


def processes_naming(*marks: str) -> list[tuple[int, str]]:
    """Processes (but this one) whose command line holds any of ``marks``."""
    marks = tuple(mark.encode() for mark in marks)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if any(mark in cmdline for mark in marks):
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port free on every interface now, below the kernel's ephemeral ports. A client
    that connects before its server binds (a ZMQ socket retrying its connect) can be given
    an ephemeral port as its own source port, and connect to itself on it, which takes the
    port from the server: so vLLM's event publisher once failed to bind in CI."""
    first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    while True:
        port = random.randrange(1024, first_ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port


def block_hash(tag: str, i: int) -> bytes:
    """A distinct 16-byte hash per (tag, i)."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}/{i}").bytes


def content(block_hash: bytes, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """The bytes a block named ``block_hash`` holds in these tests."""
    rng = np.random.default_rng(int.from_bytes(block_hash[:8], "little"))
    return rng.integers(0, 256, block_bytes, dtype=np.uint8)


@dataclass
class Daemon:
    """A ``kvtier serve`` subprocess on private paths (socket, arena name, data dir)."""

    host_bytes: int = 64 * BLOCK_BYTES
    disk_bytes: int = 4096 * BLOCK_BYTES
    lease_s: float = 30.0
    tcp_port: int | None = None
    token: str | None = None
    extra: list[str] = field(default_factory=list)
    root: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir="/tmp"))
    )
    name: str = field(default_factory=daemon_name)
    stats_port: int | None = field(default_factory=free_port)
    """None: no flag, the daemon's default (9477, or any free port while that one is taken)."""
    nofile: tuple[int, int] | None = None
    """The daemon's descriptor limit (soft, hard), where not this process's own."""
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.root / "d.sock"

    @property
    def target(self) -> str:
        return contract.unix_target(self.socket)

    @property
    def log(self) -> Path:
        return self.root / "daemon.log"

    def command(self) -> list[str]:
        cmd = [DAEMON_PYTHON]
        if self.nofile is not None:
            cmd += ["-c", SET_NOFILE, *map(str, self.nofile)]
        cmd += [
            "-m",
            "kvtier.service.serve",
            "--name",
            self.name,
            "--socket",
            str(self.socket),
            "--data-dir",
            str(self.root / "data"),
            "--host-bytes",
            str(self.host_bytes),
            "--disk-bytes",
            str(self.disk_bytes),
            "--lease-s",
            str(self.lease_s),
            *self.extra,
        ]
        if self.stats_port is not None:
            cmd += ["--stats-port", str(self.stats_port)]
        if self.tcp_port is not None:
            (self.root / "token").write_text(self.token or "")
            cmd += ["--tcp", f"127.0.0.1:{self.tcp_port}", "--token-file", str(self.root / "token")]
        return cmd

    def start(self) -> Daemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        self.wait_serving()
        return self

    def run_to_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        """Runs a daemon expected to stop by itself (a failing start); returns its exit code."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        return self.proc.wait(timeout=timeout)

    @property
    def stats_url(self) -> str:
        """Where the daemon says its statistics endpoint listens (from its log)."""
        match = re.search(r"stats (http://\S+)/metrics", self.log.read_text())
        assert match, self.log.read_text()
        return match.group(1)

    def wait_serving(self) -> None:
        """Blocks until the health service says SERVING (the daemon is fully up)."""
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(), timeout=START_TIMEOUT_S, wait_for_ready=True
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, self.log.read_text()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    @contextlib.contextmanager
    def frozen(self):
        """The daemon stopped (SIGSTOP) for the block's length: its sockets stay open and
        nothing on them is answered; it goes on (SIGCONT) however the block ends."""
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield self
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        return self.kill(signal.SIGTERM)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        for arena in arenas_of(self.name):
            arena.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.exists():
            # The relay outlives its killed daemon by a moment, and may bind one more address
            # in the directory while it is being removed: remove it again once the relay is gone.
            wait_until(lambda: not processes_naming(str(self.root)), "the relay to end")
            shutil.rmtree(self.root, ignore_errors=True)

    def stub(self) -> tuple[grpc.Channel, pb_grpc.KvTierStub]:
        channel = grpc.insecure_channel(self.target, options=contract.CHANNEL_OPTIONS)
        return channel, pb_grpc.KvTierStub(channel)

    def client(self, **kwargs) -> DaemonClient:
        kwargs.setdefault("block_tokens", 16)
        client = DaemonClient(SIGNATURE, BLOCK_BYTES, target=self.target, **kwargs)
        assert client.wait_connected(START_TIMEOUT_S), self.log.read_text()
        return client

    def stats(self) -> pb.StatsResponse:
        channel, stub = self.stub()
        with channel:
            return stub.Stats(pb.StatsRequest(), timeout=10)


@contextlib.contextmanager
def in_process_daemon(host_bytes: int) -> Iterator[daemon_module.Daemon]:
    """A daemon's operations called in this process (no server, no disk tier), shut down
    after."""
    config = DaemonConfig(name=daemon_name(), host_bytes=host_bytes, disk_bytes=0)
    loop = asyncio.new_event_loop()
    daemon = daemon_module.Daemon(config, BlockStore(config, EventHub(loop)))
    try:
        yield daemon
    finally:
        daemon.shutdown()
        loop.close()


def open_session(
    stub: pb_grpc.KvTierStub, signature: bytes = SIGNATURE, block_bytes: int = BLOCK_BYTES, **kwargs
) -> pb.OpenResponse:
    return stub.Open(
        pb.OpenRequest(
            client_name="raw",
            layout_signature=signature,
            block_bytes=block_bytes,
            block_tokens=16,
            protocol_version=contract.PROTOCOL_VERSION,
        ),
        timeout=10,
        **kwargs,
    )


def store(client: DaemonClient, hashes: list[bytes]) -> list[bytes]:
    """Reserves, writes and commits ``hashes``; returns those this call stored."""
    slots = client.reserve(hashes)
    mine = [(h, s) for h, s in zip(hashes, slots, strict=True) if s >= 0]
    for h, s in mine:
        client.slab[s].numpy()[:] = content(h)
    assert client.commit([s for _, s in mine])
    return [h for h, _ in mine]


def load(client: DaemonClient, hashes: list[bytes]) -> list[bytes]:
    """Acquires, checks and releases ``hashes``; returns those that came back exact."""
    slots = client.acquire(hashes)
    try:
        for h, s in zip(hashes, slots, strict=False):
            np.testing.assert_array_equal(client.slab[s].numpy(), content(h))
    finally:
        client.release(slots)
    return hashes[: len(slots)]


def daemon_stats(daemon: Daemon) -> dict:
    """The daemon's ``/stats`` JSON (every counter, per tier, and the slots sessions hold)."""
    url = f"http://127.0.0.1:{daemon.stats_port}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Polls ``condition`` until it holds (things happen asynchronously); fails the test after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def relay_pids(daemon: Daemon) -> list[int]:
    """Processes running the daemon's relay (its private directory is on their command line)."""
    private = str(private_dir_of(daemon.socket))
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"kvtier.service.relay.unix" in args and private.encode() in args:
                pids.append(int(entry))
    return pids
