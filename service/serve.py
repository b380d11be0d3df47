"""``kvtier serve``: the daemon's lifecycle in one place.

Builds the store (each layout's arena and tiers come with its first client), the gRPC servers
(a unix socket, mode 0600, served through a relay process that binds each connection to its
client's pid, and TCP with a token only when asked), health checking, reflection
and the statistics endpoint; logs where each listens; then serves until SIGTERM or SIGINT.
Shutdown: health goes NOT_SERVING, keep-alive and event streams end, in-flight calls get
``grace_s`` to finish, every session's slots are given back, the disk writers flush and LMDB
closes — a restart finds every committed block. A start that fails at any step undoes what
it made (socket, stats endpoint, arenas, disk tier locks) and exits 1 with one log line
saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.service import flags
from kvtier.service.arena import ArenaError
from kvtier.service.config import DEFAULT_STATS_PORT, ConfigError, DaemonConfig
from kvtier.service.daemon import Daemon
from kvtier.service.events import EventHub
from kvtier.service.relay.limits import raise_fd_limit
from kvtier.service.relay.unix import (
    RelayProcess,
    clear_private_dir,
    client_pid,
    longest_address,
    private_dir_of,
    upstream_of,
)
from kvtier.service.rpc.auth import TokenInterceptor
from kvtier.service.rpc.grpc_logs import limit_grpc_logs
from kvtier.service.rpc.handlers import add_servicer
from kvtier.service.rpc.servicer import KvTierServicer
from kvtier.service.rpc.slot_channel import SlotChannelServer
from kvtier.service.stats.http import StatsServer
from kvtier.service.stats.metrics import Metrics
from kvtier.service.store import BlockStore
from kvtier.tiers.tunables import TUNABLES as TIER_TUNABLES

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvTier"].full_name


class StartError(RuntimeError):
    """The daemon cannot start; the message says why and what to change."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # Heavy calls (a 65k-hash Lookup) run on worker threads in Python; the event loop must get
    # the GIL back from them within 0.5 ms, not the default 5 ms, or every small call waiting
    # behind one pays it (``kvtier bench daemon``'s small_lookup_p99_ms shows it). The disk
    # tier's threads need it as much (``TierTunables.switch_interval_s``).
    sys.setswitchinterval(TIER_TUNABLES.switch_interval_s)
    try:
        config = flags.from_args(args)
        asyncio.run(serve(config))
    except (StartError, ConfigError) as exc:
        log.error("kvtier serve: %s", exc)
        return 1
    return 0


async def serve(config: DaemonConfig) -> None:
    """Runs the daemon until SIGTERM/SIGINT.

    A start that fails at any step removes what it made (socket, stats endpoint, the store
    with any arena and disk tier lock it took) and raises ``StartError`` saying why.
    """
    limit_grpc_logs()  # grpcio logs a traceback per undecodable request to health or reflection
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with contextlib.AsyncExitStack() as made:
        try:
            servers, health, events = await _start(config, stopping, made)
        except Exception as exc:
            log.debug("kvtier %r: start-up failed", config.name, exc_info=True)
            raise StartError(_why(exc)) from None
        try:
            await stopping.wait()
            log.info("kvtier %r stopping: NOT_SERVING, finishing in-flight calls", config.name)
            await health.enter_graceful_shutdown()
            events.close()
            await asyncio.gather(*(s.stop(config.grace_s) for s in servers))
        finally:
            stopping.set()
    log.info("kvtier %r stopped; disk tier flushed and closed", config.name)


async def _start(
    config: DaemonConfig, stopping: asyncio.Event, made: contextlib.AsyncExitStack
) -> tuple[list[grpc.aio.Server], health_aio.HealthServicer, EventHub]:
    """Builds and starts everything, entering each part's undoing into ``made`` as it goes."""
    token = config.read_token() if config.tcp else None
    if config.tcp and not token:
        raise StartError(f"--tcp needs a token: --token-file or ${contract.TOKEN_ENV}")
    socket_path = config.socket_path
    _prepare_socket(socket_path)
    private_dir = _prepare_private_dir(socket_path)
    made.callback(_remove_dir, private_dir)  # last: after every socket in it is gone

    events = EventHub(asyncio.get_running_loop(), max_subscribers=config.max_watchers)
    store = BlockStore(config, events)
    made.push_async_callback(asyncio.to_thread, store.close)  # idempotent: after the daemon's
    daemon = Daemon(config, store)
    made.push_async_callback(asyncio.to_thread, daemon.shutdown)  # sessions, then the store
    metrics = Metrics(daemon.stats)
    servicer = KvTierServicer(
        daemon, events, metrics, stopping, client_pid=lambda peer: client_pid(peer, private_dir)
    )
    made.callback(servicer.close)
    health = health_aio.HealthServicer()
    servers = [_server(servicer, health, None)]
    made.push_async_callback(servers[0].stop, None)
    upstream = upstream_of(private_dir)
    with _private_umask():
        servers[0].add_insecure_port(contract.unix_target(upstream))
        await servers[0].start()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        made.callback(listener.close)
        listener.bind(os.fspath(socket_path))
    made.callback(_remove_socket, socket_path, os.lstat(socket_path).st_ino)
    os.chmod(socket_path, 0o600)
    listener.listen(128)
    raise_fd_limit()  # gRPC holds a descriptor for each relayed connection
    # a session's connection, room for each to reconnect, and the event watchers'
    relay = RelayProcess(listener, private_dir, 2 * config.max_sessions + config.max_watchers)
    await relay.start()
    made.push_async_callback(relay.stop)
    channel_path = contract.slot_channel_path(socket_path)
    _prepare_socket(channel_path)
    # a session's channel, and room for each to reconnect
    channel = SlotChannelServer(
        servicer, channel_path, servicer.client_pid, 2 * config.max_sessions
    )
    made.push_async_callback(channel.close)
    with _private_umask():
        await channel.start()
    made.callback(_remove_socket, channel_path, os.lstat(channel_path).st_ino)
    where = [
        f"grpc unix:{socket_path} (through a relay that knows each client's pid)",
        f"slot channel {channel_path}",
    ]
    if config.tcp:
        tcp = _server(servicer, health, TokenInterceptor(token))
        made.push_async_callback(tcp.stop, None)
        port = tcp.add_insecure_port(config.tcp)
        await tcp.start()
        servers.append(tcp)
        where.append(f"grpc tcp {config.tcp} (port {port}, token required)")
    if config.stats_port != -1:
        http = _stats_server(config, metrics, daemon)
        made.callback(http.close)
        where.append(f"stats {http.url}/metrics and /stats")
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    interval = min(config.lease_s / 4, config.lookup_hold_s / 2 or config.lease_s / 4)
    reaper = asyncio.create_task(_reap(daemon, interval))
    made.callback(reaper.cancel)
    disk = f"disk tiers under {config.disk_path}" if config.disk_bytes else "no disk tier"
    log.info(
        "kvtier %r serving: %s; %d B of shared memory per layout (up to %d); %s",
        config.name,
        "; ".join(where),
        config.host_bytes,
        config.max_layouts,
        disk,
    )
    return servers, health, events


def _stats_server(config: DaemonConfig, metrics: Metrics, daemon: Daemon) -> StatsServer:
    """The HTTP endpoint: on the port asked for, or on the default one, or on any free port
    while another process (a second daemon) holds the default."""
    host = config.stats_host
    port = DEFAULT_STATS_PORT if config.stats_port is None else config.stats_port
    try:
        return StatsServer(host, port, metrics.registry, daemon.stats)
    except OSError as exc:
        if config.stats_port is not None or exc.errno != errno.EADDRINUSE:
            raise StartError(
                f"statistics endpoint {host}:{port}: {exc.strerror}; choose another "
                "--stats-port (0: any free port, -1: none)"
            ) from None
    http = StatsServer(host, 0, metrics.registry, daemon.stats)
    log.warning(
        "kvtier %r: stats port %d is taken (another daemon?); statistics on port %d instead",
        config.name,
        DEFAULT_STATS_PORT,
        http.port,
    )
    return http


def _why(exc: BaseException) -> str:
    """One line saying why the start failed."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, (StartError, ConfigError, ArenaError, PermissionError, RuntimeError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


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


async def _reap(daemon: Daemon, interval_s: float) -> None:
    """Ends lapsed sessions and lookups' holds, a few times per lease and per hold."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(daemon.reap)


def _prepare_socket(path: Path) -> None:
    """Makes sure the socket's directory is ours alone (``contract.ensure_socket_dir``) and
    clears a dead daemon's socket. Only ever a socket is removed: anything else at ``path`` is
    a start-up error and stays as it is."""
    contract.ensure_socket_dir(path.parent)
    if len(os.fsencode(path)) > 107:
        raise StartError(f"unix socket path {path} is longer than 107 bytes; use --socket")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartError(
            f"{path} exists and is not a socket ({_kind(st.st_mode)}); kvtier replaces only a "
            "dead daemon's socket: move it away or choose another --socket"
        )
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            _remove_socket(path, st.st_ino)
            return
    raise StartError(f"a daemon already listens on {path}; stop it or use --name/--socket")


def _prepare_private_dir(public: Path) -> Path:
    """The directory of gRPC's own socket and the relay's addresses (``relay.unix``), beside
    the public socket: ours alone, and cleared of a dead daemon's sockets."""
    private_dir = private_dir_of(public)
    contract.ensure_socket_dir(private_dir)
    if longest_address(private_dir) > 107:
        raise StartError(
            f"unix socket path {public} leaves no room for the relay's addresses under "
            f"{private_dir} (107 bytes at most); use a shorter --socket"
        )
    clear_private_dir(private_dir)
    return private_dir


def _remove_dir(path: Path) -> None:
    """Removes ``path`` if it is empty (never anything someone put there)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def _remove_socket(path: Path, inode: int) -> None:
    """Unlinks ``path`` if it is still the socket ``inode`` (never another daemon's, nor a
    file someone put there since)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
            path.unlink()


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "a symlink" if stat.S_ISLNK(mode) else "not a socket"


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
