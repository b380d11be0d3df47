"""The daemon's settings: embedded defaults, then a TOML file, then command-line flags.

The defaults work on a fresh machine with no root and no flags: the socket goes under the
user's runtime directory, the disk tier under ``~/.local/share/kvtier/<name>``, statistics on
127.0.0.1. A TOML file uses the field names below (``host_bytes = "4GiB"`` or plain integers).

Every value is checked against its field's type, read from ``DaemonConfig`` itself, so a field
added later is checked too: a value of the wrong type is a ``ConfigError`` naming the key and
where it came from (the TOML file, or the flag), never a traceback from deep inside the daemon.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated

from kvtier.proto import contract
from kvtier.tiers.host.admission import DEFAULT_POLICY, POLICIES
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.tier import RemoteSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 needs the tomli backport
    import tomli as tomllib

log = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_STATS_PORT = 9477
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BYTES = "bytes"
ByteSize = Annotated[int, _BYTES]
"""A byte count that may also be written as a size: ``"2GiB"``, ``"512M"``."""


class ConfigError(ValueError):
    """A setting has a wrong type or value; ``key`` names it, the message says where it is."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def parse_size(text: str | int) -> int:
    """``"2GiB"``, ``"512M"``, ``"4096"`` or an int → bytes (binary units)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (try 2GiB, 512MiB or a byte count)")
    number, unit, _ = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def _data_home() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return Path(base) / "kvtier"


@dataclass
class DaemonConfig:
    """Everything ``kvtier serve`` can be told; ``None`` paths take per-name defaults."""

    name: str = contract.DEFAULT_NAME
    socket: Path | None = None
    tcp: str | None = None
    """``host:port`` to listen on as well; requires a token."""
    token_file: Path | None = None
    host_bytes: ByteSize = 2 * GiB
    arena_dir: Path = Path("/dev/shm")
    """Where each layout's arena (its host tier) lives; keep it on tmpfs."""
    data_dir: Path | None = None
    disk_bytes: ByteSize = 16 * GiB
    """0 disables the disk tier (commits are then not durable)."""
    disk_sync: bool = True
    """fsync each disk commit; without it commits survive a daemon crash but not a power loss."""
    stats_host: str = "127.0.0.1"
    stats_port: int | None = None
    """None: 9477, or any free port while another process holds that one (the log says which);
    0: any free port; -1: no HTTP endpoint. A port asked for that is taken stops the start."""
    lease_s: float = 30.0
    max_hashes: int = contract.MAX_HASHES
    grace_s: float = 5.0
    flush_interval_s: float = 0.02
    """Most time a committed block waits before the disk writer makes it durable."""
    max_layouts: int = 8
    """Layouts (models) served at once; each has its own host_bytes arena and disk_bytes."""
    max_sessions: int = 1024
    max_watchers: int = 64
    """WatchEvents subscribers at once."""
    session_slot_share: float = 0.5
    """Most of a layout's slots one session may hold reserved, and as many acquired."""
    pin_share: float = 0.25
    """Most of a layout's slots one session may keep pinned (``Pin``, agents' contexts)."""
    lookup_hold_s: float = 5.0
    """How long a lookup's host hits stay pinned for the acquire that follows (0: not)."""
    reserve_ahead_blocks: int = 64
    """Slots a session may keep reserved ahead of its stores, unnamed (within its share), so
    that a store reserves without a round trip (0: every store's Reserve is a call)."""
    admission: str = DEFAULT_POLICY
    """Which offered blocks enter the host tier and which go to disk, one of ``POLICIES``
    (``kvtier.tiers.host.admission``)."""
    remote: str | None = None
    """The store shared by many nodes below the disk tier (off by default): ``redis://HOST:PORT``,
    ``rediss://…``, a cluster seed list ``HOST:PORT,HOST:PORT`` or ``mooncake://MASTER``
    (``kvtier.tiers.remote.config``)."""
    remote_password_file: Path | None = None
    """The store's password; without it ``$KVTIER_REMOTE_PASSWORD``. Never in the URL."""
    remote_ca_file: Path | None = None
    remote_cert_file: Path | None = None
    remote_key_file: Path | None = None
    remote_lookup_timeout_s: float = 0.5
    remote_transfer_timeout_s: float = 5.0
    remote_queue_bytes: ByteSize = 256 << 20
    """Blocks waiting to be written to the store beyond this are dropped (and counted)."""
    disk_read_delay_ms: float = 0.0
    """Fault injection for tests and demonstrations: every disk read waits this long first,
    as a crawling disk would. 0 in service."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ConfigError("name", f"name {self.name!r}: use letters, digits, '_', '-', '.'")
        if self.host_bytes <= 0:
            raise ConfigError("host_bytes", f"host_bytes must be positive, got {self.host_bytes}")
        if self.disk_bytes < 0:
            raise ConfigError("disk_bytes", f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.lease_s <= 0:
            raise ConfigError("lease_s", f"lease_s must be positive, got {self.lease_s}")
        if not 1 <= self.max_hashes <= contract.MAX_HASHES:
            raise ConfigError("max_hashes", f"max_hashes must be in 1..{contract.MAX_HASHES}")
        if self.flush_interval_s <= 0:
            raise ConfigError("flush_interval_s", "flush_interval_s must be positive")
        for name in ("max_layouts", "max_sessions", "max_watchers"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be at least 1, got {getattr(self, name)}")
        if self.disk_read_delay_ms < 0:
            raise ConfigError("disk_read_delay_ms", "disk_read_delay_ms must be >= 0")
        if self.lookup_hold_s < 0:
            raise ConfigError("lookup_hold_s", "lookup_hold_s must be >= 0")
        if self.reserve_ahead_blocks < 0:
            raise ConfigError("reserve_ahead_blocks", "reserve_ahead_blocks must be >= 0")
        if self.admission not in POLICIES:
            raise ConfigError(
                "admission", f"admission {self.admission!r}: use one of {', '.join(POLICIES)}"
            )
        if not 0 < self.session_slot_share <= 1:
            raise ConfigError("session_slot_share", "session_slot_share must be in (0, 1]")
        if not 0 < self.pin_share <= 1:
            raise ConfigError("pin_share", "pin_share must be in (0, 1]")
        if self.stats_port is not None and not -1 <= self.stats_port <= 65535:
            raise ConfigError(
                "stats_port", f"stats_port must be in -1..65535, not {self.stats_port}"
            )
        try:
            self.remote_config()  # a bad URL or setting fails here, at start-up
        except ValueError as exc:  # its message names the URL redacted (``redact_url``)
            raise ConfigError("remote", str(exc)) from None

    @property
    def socket_path(self) -> Path:
        return self.socket or contract.default_socket(self.name)

    @property
    def disk_path(self) -> Path:
        return self.data_dir or _data_home() / self.name

    @property
    def arena_name(self) -> str:
        return f"kvtier-{self.name}"

    def remote_config(self) -> RemoteConfig | None:
        """How to open the remote tier, or None when there is none."""
        if not self.remote:
            return None
        return RemoteConfig(
            self.remote,
            password_file=self.remote_password_file,
            ca_file=self.remote_ca_file,
            cert_file=self.remote_cert_file,
            key_file=self.remote_key_file,
            settings=RemoteSettings(
                lookup_timeout_s=self.remote_lookup_timeout_s,
                transfer_timeout_s=self.remote_transfer_timeout_s,
                queue_bytes=self.remote_queue_bytes,
            ),
        )

    def read_token(self) -> str | None:
        """The TCP token: from ``token_file`` if set (warning if others may read it), else
        ``$KVTIER_TOKEN``. Raises ``ConfigError`` naming a file that cannot be read."""
        if self.token_file is None:
            return os.environ.get(contract.TOKEN_ENV, "").strip() or None
        path = self.token_file
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError("token_file", f"token file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError("token_file", f"token file {path} is not text") from None
        if mode & 0o077:
            log.warning(
                "token file %s is open to group or others (mode %03o): chmod 600 it", path, mode
            )
        return token or None


# The field types, resolved once: ``from __future__ import annotations`` leaves them strings.
_HINTS = typing.get_type_hints(DaemonConfig, include_extras=True)
_DESCRIPTIONS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Path: "a path",
    type(None): "unset",
}


def _accepted(name: str) -> tuple[tuple[type, ...], bool]:
    """The types field ``name`` takes, and whether it is a byte size."""
    hint = _HINTS[name]
    size = typing.get_origin(hint) is Annotated and _BYTES in hint.__metadata__
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint), size
    return (hint,), size


def _check_type(name: str, value: object) -> None:
    accepted, size = _accepted(name)
    for kind in accepted:
        # bool is an int to Python, but ``port = true`` is a mistake, not port 1
        if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
            return
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return
    wanted = " or ".join(_DESCRIPTIONS.get(kind, kind.__name__) for kind in accepted)
    if size:
        wanted = "a size (2GiB, 512MiB) or a byte count"
    raise ConfigError(name, f"{name} must be {wanted}, got {value!r}")


def _convert(name: str, value: object, from_flag: bool) -> object:
    """``value`` as field ``name`` takes it: a size or path given as text parsed; a flag's
    text also read as the number or switch its field wants. Anything else is left to the
    type check."""
    accepted, size = _accepted(name)
    if isinstance(value, str) and size:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(name, f"{name}: {exc}") from None
    if isinstance(value, str) and Path in accepted:
        return Path(os.path.expanduser(value))
    if float in accepted and int not in accepted and type(value) is int:
        return float(value)
    numbers = [kind for kind in (int, float) if kind in accepted]
    if isinstance(value, str) and from_flag and numbers:
        for kind in numbers:
            try:
                return kind(value)
            except ValueError:
                continue
        raise ConfigError(name, f"{name} must be {_DESCRIPTIONS[numbers[0]]}, got {value!r}")
    return value


def load(path: Path | None = None, **overrides: object) -> DaemonConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (flags) that are not None.

    Raises ``ConfigError`` naming the key and the file or flag it came from.
    """
    known = {f.name for f in fields(DaemonConfig)}
    values: dict[str, object] = {}
    where: dict[str, str] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except OSError as exc:
            raise ConfigError("config", f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"config file {path}: not valid TOML: {exc}") from None
        unknown = set(table) - known
        if unknown:
            raise ConfigError(
                sorted(unknown)[0],
                f"config file {path}: unknown settings {sorted(unknown)}; known: {sorted(known)}",
            )
        values.update(table)
        where.update({key: f"config file {path}" for key in table})
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
            where[key] = "--" + key.replace("_", "-")
    try:
        converted = {k: _convert(k, v, where[k].startswith("--")) for k, v in values.items()}
        return DaemonConfig(**converted)
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{where.get(exc.key, 'defaults')}: {exc}") from None
