"""What both ends of the wire agree on besides the messages: where, how big, how to sign in.

The daemon (``kvtier.service``) and its client (``kvtier.connector``) both import this, so the
client finds a daemon started with no flags without importing any of the daemon's code.
"""

from __future__ import annotations

import os
from pathlib import Path

PROTOCOL_VERSION = 2
HASH_BYTES = 16
DEFAULT_NAME = "default"
MAX_HASHES = 65536
"""Most hashes or slots one call may carry (a 1 MiB packed ``hashes`` field)."""
MIN_BLOCK_BYTES = 4096
"""Smallest block a daemon accepts: it bounds the number of slots (and their state) per arena."""
MAX_MESSAGE_BYTES = 256 << 20
"""gRPC message bound on both ends: one block of a large model must fit a ``Put``/``Get``."""
TOKEN_METADATA_KEY = "authorization"
TOKEN_ENV = "KVTIER_TOKEN"
"""Environment variable holding the shared token for TCP."""
SLOT_ALREADY_STORED = -1
SLOT_NO_SPACE = -2

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvtier``, else ``/tmp/kvtier-<uid>``: private to the user."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "kvtier"
    return Path("/tmp") / f"kvtier-{os.getuid()}"


def default_socket(name: str = DEFAULT_NAME) -> Path:
    """The unix socket a daemon called ``name`` listens on when not told otherwise."""
    return runtime_dir() / f"{name}.sock"


def unix_target(path: str | os.PathLike[str]) -> str:
    """The gRPC target string for a unix socket path."""
    return f"unix:{os.fspath(path)}"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries ``token``."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),)


def pid_namespace() -> int:
    """The inode of this process's pid namespace: pids compare only within one."""
    return os.stat("/proc/self/ns/pid").st_ino
