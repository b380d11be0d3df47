"""The daemon's unix socket: a relay that binds each connection to an address naming its process.

gRPC Python tells a servicer nothing about a unix-socket client: ``context.peer()`` is
``"unix:"`` for every connection, so a session id would be a bearer token any process could
use. kvtier therefore accepts on the public socket itself, reads the kernel's ``SO_PEERCRED``
of each connection, and relays its bytes to gRPC's private socket over a connection bound to
a fresh address in a private directory, ``c<relay pid>.<n>-<client pid>`` (unique across a
relay's restarts too). gRPC reports that address as the peer, so a session is bound to the
connection that opened it, as on TCP, and the daemon knows the client's pid in its own pid
namespace, whatever namespace the client runs in.

The relay runs in a process of its own (``RelayProcess``), so that relaying never waits for
the daemon's GIL, and dies with the daemon. One selector thread relays every connection
(``loop.py``), two descriptors each, up to a cap the descriptor limit leaves room for
(``limits.py``); bulk data never crosses this socket (it moves through the shared arena).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path

from kvtier.service.relay.limits import connection_cap, raise_fd_limit
from kvtier.service.relay.loop import Relay
from kvtier.service.tunables import TUNABLES

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def private_dir_of(public: Path) -> Path:
    """The relay's private directory, beside the public socket. Absolute: gRPC names a peer
    by the address as bound, and only an absolute one is taken for a relayed connection."""
    public = Path(os.path.abspath(public))
    return public.parent / f".{public.name}.d"


def upstream_of(private_dir: Path) -> Path:
    """gRPC's own socket, reached only through the relay."""
    return private_dir / "grpc.sock"


def longest_address(private_dir: Path) -> int:
    """Bytes of the longest address a relayed connection is bound to."""
    return len(os.fsencode(private_dir / f"c{2**22}.{2**63}-{2**22}"))


def client_pid(grpc_peer: str, private_dir: Path) -> int | None:
    """The client pid a relayed connection's address names (``unix:<private_dir>/c…-<pid>``)."""
    prefix = f"unix:{private_dir}/c"
    if not grpc_peer.startswith(prefix):
        return None
    _, _, pid = grpc_peer[len(prefix) :].partition("-")
    return int(pid) if pid.isdigit() else None


def clear_private_dir(private_dir: Path) -> None:
    """Removes the sockets (and only those) a relay or gRPC left in the private directory."""
    for entry in private_dir.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(entry.lstat().st_mode):
                entry.unlink()


class RelayProcess:
    """Runs the relay of ``listener`` (bound and listening) in a child process, again should
    it die, until ``stop``; it relays up to ``max_connections`` connections at once (fewer
    where the descriptor limit leaves room for fewer)."""

    def __init__(self, listener: socket.socket, private_dir: Path, max_connections: int):
        self.listener = listener
        self.private_dir = private_dir
        self.max_connections = max_connections
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        self._proc = await self._spawn()
        self._watch = asyncio.create_task(self._keep_running())

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            await self._proc.wait()
        clear_private_dir(self.private_dir)

    async def _spawn(self) -> asyncio.subprocess.Process:
        fd = self.listener.fileno()
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            str(fd),
            os.fspath(self.private_dir),
            str(os.getpid()),
            str(self.max_connections),
            pass_fds=(fd,),
        )

    async def _keep_running(self) -> None:
        while not self._stopping:
            code = await self._proc.wait()
            log.error("kvtier: the unix socket's relay exited (%s); starting it again", code)
            await asyncio.sleep(TUNABLES.relay_respawn_s)
            self._proc = await self._spawn()


def _die_with(daemon_pid: int) -> None:
    """The kernel ends this process when the daemon ends, even by SIGKILL; a daemon already
    gone before that was asked ends it now."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != daemon_pid:
        sys.exit(1)


def main(argv: list[str]) -> None:
    """``python -m kvtier.service.relay.unix FD PRIVATE_DIR DAEMON_PID MAX_CONNECTIONS``: the
    relay process."""
    _die_with(int(argv[2]))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon stops it (SIGTERM), not ^C
    fd_limit = raise_fd_limit()
    cap = connection_cap(fd_limit, int(argv[3]))
    log.info("kvtier relay: up to %d connections at once (descriptor limit %d)", cap, fd_limit)
    listener = socket.socket(fileno=int(argv[0]))
    private_dir = Path(argv[1])
    Relay(listener, private_dir, upstream_of(private_dir), cap).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
