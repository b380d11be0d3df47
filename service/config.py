"""The daemon's settings: embedded defaults, then a TOML file, then command-line flags.

The defaults work on a fresh machine with no root and no flags: the socket goes under the
user's runtime directory, the disk tier under ``~/.local/share/kvtier/<name>``, statistics on
127.0.0.1. A TOML file uses the field names below (``host_bytes = "4GiB"`` or plain integers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from kvtier.proto import contract
from kvtier.tiers.remote import RemoteSettings
from kvtier.tiers.remote_config import PASSWORD_ENV, RemoteConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 needs the tomli backport
    import tomli as tomllib

GiB = 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


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
    host_bytes: int = 2 * GiB
    data_dir: Path | None = None
    disk_bytes: int = 16 * GiB
    """0 disables the disk tier (commits are then not durable)."""
    disk_sync: bool = True
    """fsync each disk commit; without it commits survive a daemon crash but not a power loss."""
    stats_host: str = "127.0.0.1"
    stats_port: int = 9477
    """0 picks a free port; -1 disables the HTTP endpoint."""
    lease_s: float = 30.0
    max_hashes: int = contract.MAX_HASHES
    grace_s: float = 5.0
    remote: str | None = None
    """The store shared by many nodes below the disk tier (off by default): ``redis://HOST:PORT``,
    ``rediss://…``, a cluster seed list ``HOST:PORT,HOST:PORT`` or ``mooncake://MASTER``
    (``kvtier.tiers.remote_config``)."""
    remote_password_file: Path | None = None
    """The store's password; without it ``$KVTIER_REMOTE_PASSWORD``. Never in the URL."""
    remote_ca_file: Path | None = None
    remote_cert_file: Path | None = None
    remote_key_file: Path | None = None
    remote_lookup_timeout_s: float = 0.5
    remote_transfer_timeout_s: float = 5.0
    remote_queue_bytes: int = 256 << 20
    """Blocks waiting to be written to the store beyond this are dropped (and counted)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ValueError(f"daemon name {self.name!r}: use letters, digits, '_', '-', '.'")
        if self.host_bytes <= 0:
            raise ValueError(f"host_bytes must be positive, got {self.host_bytes}")
        if self.disk_bytes < 0:
            raise ValueError(f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {self.lease_s}")
        if not 1 <= self.max_hashes <= contract.MAX_HASHES:
            raise ValueError(f"max_hashes must be in 1..{contract.MAX_HASHES}")
        self.remote_config()  # a bad URL or setting fails here, at start-up

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
        """The TCP token: from ``token_file`` if set, else ``$KVTIER_TOKEN``."""
        if self.token_file is not None:
            token = Path(self.token_file).read_text().strip()
        else:
            token = os.environ.get(contract.TOKEN_ENV, "").strip()
        return token or None


_SIZES = {"host_bytes", "disk_bytes", "remote_queue_bytes"}
_PATHS = {
    "socket",
    "token_file",
    "data_dir",
    "remote_password_file",
    "remote_ca_file",
    "remote_cert_file",
    "remote_key_file",
}


def _coerce(name: str, value: object) -> object:
    if value is None:
        return None
    if name in _SIZES:
        return parse_size(value)  # type: ignore[arg-type]
    if name in _PATHS:
        return Path(os.path.expanduser(str(value)))
    return value


def load(path: Path | None = None, **overrides: object) -> DaemonConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` that are not ``None``."""
    known = {f.name for f in fields(DaemonConfig)}
    values: dict[str, object] = {}
    if path is not None:
        with open(path, "rb") as f:
            table = tomllib.load(f)
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}; known: {sorted(known)}")
        values.update(table)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return DaemonConfig(**{k: _coerce(k, v) for k, v in values.items()})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every setting; each overrides the config file."""
    d = DaemonConfig()
    add = parser.add_argument
    add("--config", type=Path, help="TOML file of settings (flags override it)")
    add("--name", help=f"daemon name: socket, arena and data dir (default {d.name!r})")
    add("--socket", type=Path, help=f"unix socket (default {contract.default_socket()})")
    add("--tcp", help="also listen on HOST:PORT (requires --token-file or $KVTIER_TOKEN)")
    add("--token-file", type=Path, help="file holding the shared token for TCP clients")
    add("--host-bytes", help="host tier (shared-memory arena) size, e.g. 2GiB (default 2GiB)")
    add("--data-dir", type=Path, help="disk tier directory (default ~/.local/share/kvtier/NAME)")
    add("--disk-bytes", help="disk tier budget, e.g. 16GiB; 0 disables it (default 16GiB)")
    add(
        "--disk-sync",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fsync every disk commit (default on)",
    )
    add("--stats-host", help="statistics HTTP address (default 127.0.0.1)")
    add("--stats-port", type=int, help="statistics HTTP port; 0 = any, -1 = off (default 9477)")
    add("--lease-s", type=float, help="session lease without keep-alive, seconds (default 30)")
    add(
        "--remote",
        metavar="URL",
        help="shared store below the disk tier: redis://HOST:PORT, rediss://..., "
        "HOST:PORT,HOST:PORT (a cluster) or mooncake://MASTER (default: none)",
    )
    add(
        "--remote-password-file",
        type=Path,
        help=f"file holding the store's password (else ${PASSWORD_ENV}; never in the URL)",
    )
    add("--remote-ca-file", type=Path, help="CA bundle to check a rediss:// store against")
    add("--remote-cert-file", type=Path, help="client certificate for a rediss:// store")
    add("--remote-key-file", type=Path, help="client key for a rediss:// store")
    add(
        "--remote-lookup-timeout-s",
        type=float,
        help=f"longest wait for the store in a lookup (default {d.remote_lookup_timeout_s})",
    )
    add(
        "--remote-transfer-timeout-s",
        type=float,
        help=f"longest wait for a get or a write batch (default {d.remote_transfer_timeout_s})",
    )
    add("--remote-queue-bytes", help="writes waiting for the store before drops (default 256MiB)")


def from_args(args: argparse.Namespace) -> DaemonConfig:
    """The config that ``kvtier serve`` flags describe."""
    names = {f.name for f in dataclasses.fields(DaemonConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return load(args.config, **overrides)
