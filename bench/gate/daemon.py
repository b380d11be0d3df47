"""The daemon of ``kvtier bench gate``: one data directory, restarted with or without a crawl.

Restarting the daemon on its data directory empties the host tier and keeps the disk tier, so
every block stored before is then a disk hit; the restart is also how the disk's speed changes,
``--disk-read-delay-ms`` being the daemon's fault injection for reads. The engine's clients
reattach by themselves.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

START_TIMEOUT_S = 120.0
WAIT_TIMEOUT_S = 300.0
POLL_S = 0.05
IDLE_S = 1.0


class GateDaemon:
    """A ``kvtier serve`` subprocess on ``root`` (socket, data directory, log)."""

    def __init__(self, root: Path, host_bytes: int, disk_bytes: int, name: str):
        self.root = root
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes
        self.name = name
        self.socket = root / "d.sock"
        self.target = contract.unix_target(self.socket)
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.read_delay_ms = 0.0

    def start(self, read_delay_ms: float = 0.0) -> None:
        """Starts the daemon (reads delayed by ``read_delay_ms``) and waits until it serves."""
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            *(sys.executable, "-m", "kvtier.service.serve"),
            *("--name", self.name, "--socket", str(self.socket)),
            *("--data-dir", str(self.root / "data"), "--stats-port", "-1"),
            *("--host-bytes", str(self.host_bytes), "--disk-bytes", str(self.disk_bytes)),
            *("--disk-read-delay-ms", str(read_delay_ms)),
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.read_delay_ms = read_delay_ms
        with grpc.insecure_channel(self.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=START_TIMEOUT_S, wait_for_ready=True
            )
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"the daemon did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM: the daemon flushes its disk writes and exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(WAIT_TIMEOUT_S)

    def restart(self, read_delay_ms: float) -> None:
        """Stops and starts the daemon on the same data directory, once every block is on
        disk."""
        self.wait_written()
        self.stop()
        self.start(read_delay_ms)

    def stats(self) -> pb.StatsResponse:
        with grpc.insecure_channel(self.target) as channel:
            return pb_grpc.KvTierStub(channel).Stats(pb.StatsRequest(), timeout=30)

    def wait_written(self) -> None:
        """Waits until every committed block is on disk."""
        self._wait(lambda s: all(not lay.writing_behind for lay in s.layouts), "disk writes")

    def disk_blocks_read(self) -> int:
        """Blocks this daemon process has read from its disk tier."""
        return sum(t.blocks_loaded for t in self.stats().tiers if t.tier == "disk")

    def wait_reads_idle(self) -> None:
        """Waits until the disk tier has read nothing for ``IDLE_S``."""
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        last = self.disk_blocks_read()
        while time.monotonic() < deadline:
            time.sleep(IDLE_S)
            now = self.disk_blocks_read()
            if now == last:
                return
            last = now
        raise RuntimeError(f"the disk tier was still reading after {WAIT_TIMEOUT_S:.0f} s")

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not done(self.stats()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting for {what}: {self.log.read_text()[-2000:]}")
            time.sleep(POLL_S)
