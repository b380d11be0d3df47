"""What both ends of the wire agree on besides the messages: where, how big, how to sign in.

The daemon (``kvtier.service``) and its client (``kvtier.connector``) both import this, so the
client finds a daemon started with no flags without importing any of the daemon's code.
"""

from __future__ import annotations

import os
import pwd
import stat
import struct
from pathlib import Path

PROTOCOL_VERSION = 2
HASH_BYTES = 16
DEFAULT_NAME = "default"
MAX_HASHES = 65536
"""Most hashes or slots one call may carry (a 1 MiB packed ``hashes`` field)."""
MAX_SLOT_OPS = 1024
"""Most operations one ``SlotOpBatch`` may carry."""
SLOT_BATCH_BYTES = 1 << 20
"""A client closes a ``SlotOpBatch`` once it holds this many bytes; the daemon takes a batch
of up to this plus the largest single operation."""
MAX_PIN_S = 3600.0
"""Longest pin one ``Pin`` may ask for (an agent's context between its calls, not a store)."""
MIN_BLOCK_BYTES = 4096
"""Smallest block a daemon accepts: it bounds the number of slots (and their state) per arena."""
MAX_MESSAGE_BYTES = 256 << 20
"""gRPC message bound on both ends: one block of a large model must fit a ``Put``/``Get``."""
TOKEN_METADATA_KEY = "authorization"
TOKEN_ENV = "KVTIER_TOKEN"
"""Environment variable holding the shared token for TCP."""
SLOT_ALREADY_STORED = -1
SLOT_NO_SPACE = -2
EVENTS_LOST = "kvtier: events lost"
"""Starts the details of the ``ABORTED`` status that ends a ``WatchEvents`` stream whose
watcher fell too far behind to be sent every event: what it knows of the tiers may be stale,
so it watches again with a replay."""

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


class UnsafeSocketDirectory(PermissionError):
    """The socket's directory could be controlled by another user; the message says how."""


def ensure_socket_dir(path: str | os.PathLike[str]) -> Path:
    """Makes sure the directory that holds a unix socket is this user's alone; returns it.

    Creates it (mode 0700) if missing, and any missing directory above it (0700 too: a parent
    others could write to would let them rename ours away and put theirs in its place). Then
    checks it as ``check_socket_dir`` does. The daemon calls this before it binds.
    """
    path = Path(os.path.abspath(path))
    _check_symlinks(path)
    missing = []
    for directory in (path, *path.parents):
        if directory.exists():
            break
        missing.append(directory)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue  # made meanwhile: the checks below judge it
        os.chmod(directory, 0o700)  # whatever the umask said
    if not check_socket_dir(path):
        raise FileNotFoundError(f"socket directory {path} could not be made (gone meanwhile)")
    return path


def check_socket_dir(path: str | os.PathLike[str]) -> bool:
    """Whether the directory that holds a unix socket exists; raises if it could be controlled
    by another user.

    Refuses, with ``UnsafeSocketDirectory`` naming the directory, its owner and mode: one owned
    by another user or writable by group or others (someone else could swap the socket and
    receive the engine's connection, e.g. by creating the predictable ``/tmp/kvtier-<uid>``
    first), and a path component that is a symlink owned by another user (one we or root could
    not have made). A client calls this before it connects: it makes nothing, so an engine
    waiting for a daemon that has not started leaves no directory behind.
    """
    path = Path(os.path.abspath(path))
    _check_symlinks(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    uid = os.getuid()
    mode = stat.S_IMODE(st.st_mode)
    found = f"owner {_user(st.st_uid)}, mode {mode:04o}"
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDirectory(f"socket directory {path} is not a directory ({found})")
    if st.st_uid != uid:
        raise UnsafeSocketDirectory(
            f"socket directory {path} belongs to another user ({found}), not to "
            f"{_user(uid)}; remove it or choose another path (--socket)"
        )
    if mode & 0o022:
        raise UnsafeSocketDirectory(
            f"socket directory {path} is writable by group or others ({found}); "
            f"chmod 700 it or choose another path (--socket)"
        )
    return True


def _check_symlinks(path: Path) -> None:
    """Refuses a symlink among ``path``'s components that neither root nor this user owns."""
    trusted = (0, os.getuid())
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            raise UnsafeSocketDirectory(
                f"socket directory {path}: {current} is a symlink owned by "
                f"{_user(st.st_uid)}, not by you or root; remove it or choose another path"
            )


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def default_socket(name: str = DEFAULT_NAME) -> Path:
    """The unix socket a daemon called ``name`` listens on when not told otherwise."""
    return runtime_dir() / f"{name}.sock"


def unix_target(path: str | os.PathLike[str]) -> str:
    """The gRPC target string for a unix socket path."""
    return f"unix:{os.fspath(path)}"


def slot_channel_path(socket: str | os.PathLike[str]) -> Path:
    """The slot channel of the daemon listening on ``socket`` (``service.rpc.slot_channel``):
    beside it, where only the daemon's user may enter."""
    return Path(f"{os.path.abspath(os.fspath(socket))}.slots")


FRAME = struct.Struct("<I")
"""The length before each message of the slot channel."""


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries ``token``."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),)


def pid_namespace() -> int:
    """The inode of this process's pid namespace: pids compare only within one."""
    return os.stat("/proc/self/ns/pid").st_ino
