"""A private ``redis-server`` process on localhost, for benchmarks and tests.

No persistence, an LRU over ``maxmemory`` (as a cache store is run), a scratch directory of its
own. With ``cluster=True`` it is a cluster node that serves the slots it still has when another
node is lost, as a cache should (``cluster-require-full-coverage no``); ``LocalCluster`` in the
tests joins such nodes with ``redis-cli --cluster create``.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

READY_TIMEOUT_S = 30.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 whose cluster bus port (+10000) is free as well."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisProcess:
    """One ``redis-server`` (start it with ``start``; ``close`` kills it and removes its files)."""

    def __init__(
        self,
        port: int | None = None,
        *,
        maxmemory: int = 1 << 30,
        cluster: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            str(maxmemory),
            "--maxmemory-policy",
            "allkeys-lru",
            *extra,
        ]
        if cluster:
            self.args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
                "--cluster-require-full-coverage",
                "no",
                "--cluster-allow-reads-when-down",
                "yes",
            ]
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}"

    def client(self) -> redis.Redis:
        """A plain client, for what a test does to the store behind the tier's back."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def start(self) -> RedisProcess:
        """Starts the server (again, after ``kill``, on the same port, empty) and waits until it
        answers."""
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        with self.client() as client:
            while True:
                try:
                    client.ping()
                    return self
                except redis.AuthenticationError:
                    return self  # it answers, and wants a password (--requirepass)
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(
                            f"redis-server on {self.port} did not start: "
                            + (self.dir / "redis.log").read_text()[-2000:]
                        ) from None
                    time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the store vanishes with everything it held."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the store still accepts connections but answers nothing (a slow store)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
