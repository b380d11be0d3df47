"""How many connections the relay takes at once, and the descriptor limit that bounds it.

Each relayed connection holds two descriptors in the relay (the client's socket and the one to
gRPC) and one in the daemon (gRPC's end). Both processes raise their soft ``RLIMIT_NOFILE`` to
the hard limit, the most an unprivileged process may hold, and the relay refuses connections
beyond what that limit leaves room for, so that neither process ever meets ``EMFILE``.
"""

from __future__ import annotations

import resource

RELAY_OWN_FDS = 32
"""Descriptors the relay holds besides its connections: stdio, the listener, the selector."""
DAEMON_OWN_FDS = 256
"""Descriptors the daemon holds besides relayed connections: gRPC's threads and listeners,
every layout's arena, disk tier and LMDB files, the statistics endpoint, TCP clients."""
_UNLIMITED = 1 << 20
"""What an unlimited soft limit counts as: the kernel's default ``fs.nr_open``."""


def raise_fd_limit() -> int:
    """Raises this process's soft descriptor limit to its hard limit; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # an unlimited hard limit, which the kernel caps lower (fs.nr_open)
    return _UNLIMITED if soft == resource.RLIM_INFINITY else soft


def connection_cap(fd_limit: int, wanted: int) -> int:
    """Connections the relay takes at once: ``wanted``, or fewer where ``fd_limit`` (the
    relay's and the daemon's, which inherit one another's) would run out first."""
    room = min((fd_limit - RELAY_OWN_FDS) // 2, fd_limit - DAEMON_OWN_FDS)
    return max(1, min(wanted, room))
