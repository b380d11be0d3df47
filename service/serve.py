"""``kvtier serve``: the daemon's lifecycle in one place.

Builds the store (each layout's arena and tiers come with its first client), the gRPC servers
(a unix socket, mode 0600, and TCP with a token only when asked), health checking, reflection
and the statistics endpoint; logs where each listens; then serves until SIGTERM or SIGINT.
Shutdown: health goes NOT_SERVING, keep-alive and event streams end, in-flight calls get
``grace_s`` to finish, every session's slots are given back, the disk writers flush and LMDB
closes — a restart finds every committed block.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.service import config as config_mod
from kvtier.service.arena import ArenaError
from kvtier.service.auth import TokenInterceptor
from kvtier.service.config import DaemonConfig
from kvtier.service.daemon import Daemon
from kvtier.service.events import EventHub
from kvtier.service.handlers import add_servicer
from kvtier.service.metrics import Metrics
from kvtier.service.servicer import KvTierServicer
from kvtier.service.stats_http import StatsServer
from kvtier.service.store import BlockStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvTier"].full_name


class StartError(RuntimeError):
    """The daemon cannot start; the message says why and what to change."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_mod.from_args(args)
        asyncio.run(serve(config))
    except (StartError, ArenaError, ValueError, OSError) as exc:
        log.error("kvtier serve: %s", exc)
        return 1
    return 0


async def serve(config: DaemonConfig) -> None:
    """Runs the daemon until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    token = config.read_token() if config.tcp else None
    if config.tcp and not token:
        raise StartError(f"--tcp needs a token: --token-file or ${contract.TOKEN_ENV}")
    socket_path = config.socket_path
    _prepare_socket(socket_path)

    events = EventHub(loop, max_subscribers=config.max_watchers)
    store = BlockStore(config, events)
    daemon = Daemon(config, store)
    metrics = Metrics(daemon.stats)
    servicer = KvTierServicer(daemon, events, metrics, stopping)
    health = health_aio.HealthServicer()
    servers = [_server(servicer, health, None)]
    with _private_umask():
        servers[0].add_insecure_port(contract.unix_target(socket_path))
        await servers[0].start()
    os.chmod(socket_path, 0o600)
    where = [f"grpc unix:{socket_path}"]
    if config.tcp:
        tcp = _server(servicer, health, TokenInterceptor(token))
        port = tcp.add_insecure_port(config.tcp)
        await tcp.start()
        servers.append(tcp)
        where.append(f"grpc tcp {config.tcp} (port {port}, token required)")
    http = None
    if config.stats_port >= 0:
        http = StatsServer(config.stats_host, config.stats_port, metrics.registry, daemon.stats)
        where.append(f"stats {http.url}/metrics and /stats")
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reaper = asyncio.create_task(_reap(daemon, config.lease_s))
    disk = f"disk tiers under {config.disk_path}" if config.disk_bytes else "no disk tier"
    log.info(
        "kvtier %r serving: %s; %d B of shared memory per layout (up to %d); %s",
        config.name,
        "; ".join(where),
        config.host_bytes,
        config.max_layouts,
        disk,
    )
    try:
        await stopping.wait()
        log.info("kvtier %r stopping: NOT_SERVING, finishing in-flight calls", config.name)
        await health.enter_graceful_shutdown()
        events.close()
        await asyncio.gather(*(s.stop(config.grace_s) for s in servers))
    finally:
        reaper.cancel()
        stopping.set()
        await asyncio.to_thread(daemon.shutdown)
        servicer.close()
        if http is not None:
            http.close()
        socket_path.unlink(missing_ok=True)
        log.info("kvtier %r stopped; disk tier flushed and closed", config.name)


def _server(
    servicer: KvTierServicer,
    health: health_aio.HealthServicer,
    interceptor: grpc.aio.ServerInterceptor | None,
) -> grpc.aio.Server:
    server = grpc.aio.server(
        interceptors=[interceptor] if interceptor else None,
        options=contract.CHANNEL_OPTIONS,
    )
    add_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    return server


async def _reap(daemon: Daemon, lease_s: float) -> None:
    """Ends lapsed sessions a few times per lease."""
    while True:
        await asyncio.sleep(lease_s / 4)
        daemon.reap()


def _prepare_socket(path: Path) -> None:
    """Makes the socket's directory (0700) and clears a dead daemon's socket file."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if len(os.fsencode(path)) > 107:
        raise StartError(f"unix socket path {path} is longer than 107 bytes; use --socket")
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
    raise StartError(f"a daemon already listens on {path}; stop it or use --name/--socket")


@contextlib.contextmanager
def _private_umask():
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.service.serve``: the daemon alone, for service units and tests."""
    parser = argparse.ArgumentParser(prog="kvtier-serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
