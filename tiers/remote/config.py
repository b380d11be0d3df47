"""Where the remote tier's store is, from one URL, and how to open it.

Accepted URLs::

    redis://[USER@]HOST[:PORT][/DB]        one Valkey/Redis server (rediss:// over TLS)
    redis://HOST:PORT,HOST:PORT,...        a cluster, found from these seeds (rediss:// too)
    redis+cluster://HOST[:PORT][,...]      a cluster, even from a single seed (rediss+cluster://)
    HOST:PORT,HOST:PORT,...                a cluster seed list
    mooncake://MASTER[:PORT][?metadata=URL&local_host=HOST&segment=BYTES&buffer=BYTES]

Passwords never come in the URL (it is shown in process lists and logs): from
``password_file``, else from the environment variable ``password_env`` (``KVTIER_REMOTE_PASSWORD``
by default). IPv6 hosts go in brackets. Every message that names a URL names it through
``redact_url``, so a password put there by mistake is not echoed either.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import HASH_VERSION
from kvtier.tiers.remote.backend import RemoteBackend
from kvtier.tiers.remote.format import MAX_META_BYTES, key_prefix, value_size
from kvtier.tiers.remote.mooncake import MooncakeBackend, MooncakeOptions
from kvtier.tiers.remote.tier import RemoteSettings, RemoteTier

if TYPE_CHECKING:
    from kvtier.tiers.remote.redis import RedisOptions

PASSWORD_ENV = "KVTIER_REMOTE_PASSWORD"
REDIS_PORT = 6379
MOONCAKE_PORT = 50051
_HOST = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<name>[^:\[\]]+))(?::(?P<port>\d{1,5}))?$")
_MOONCAKE_KEYS = {"metadata", "local_host", "segment", "buffer", "protocol"}


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed store URL."""

    kind: str
    """``redis``, ``cluster`` or ``mooncake``."""
    hosts: tuple[tuple[str, int], ...]
    tls: bool = False
    db: int = 0
    username: str | None = None
    query: tuple[tuple[str, str], ...] = ()


def redact_url(url: str) -> str:
    """``url`` with its user info, and that of any URL inside it (a query's metadata server),
    replaced by ``***``.

    The user info of each URL runs to its last ``@`` before the next ``://`` (where a URL
    inside it begins), as ``parse_url`` reads it: a password holding ``/``, ``?`` or ``@``
    is redacted whole, never cut where a host would begin."""
    segments = url.split("://")
    for i, segment in enumerate(segments):
        _, at, rest = segment.rpartition("@")
        if at:
            segments[i] = f"***@{rest}"
    return "://".join(segments)


def parse_url(url: str) -> Endpoint:
    """Parses a store URL (see the module docstring); ``ValueError`` says what is wrong."""
    text = url.strip()
    shown = redact_url(text)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "redis+cluster", text
    scheme = scheme.lower()
    tls = scheme.startswith("rediss")
    kinds = {"redis": "redis", "rediss": "redis", "redis+cluster": "cluster"}
    kinds |= {"rediss+cluster": "cluster", "mooncake": "mooncake"}
    if scheme not in kinds:
        raise ValueError(f"remote store {shown!r}: unknown scheme {scheme!r}; use {sorted(kinds)}")
    kind = kinds[scheme]
    inner = rest.find("://")  # a URL in the query (Mooncake's metadata server) begins here
    userinfo, at, _ = (rest if inner < 0 else rest[:inner]).rpartition("@")
    if at:
        rest = rest[len(userinfo) + 1 :]
    if ":" in userinfo:
        raise ValueError(
            f"remote store {shown!r}: no password in the URL; put it in a file "
            f"(remote_password_file) or ${PASSWORD_ENV}"
        )
    rest, _, query_text = rest.partition("?")
    hostlist, _, path = rest.partition("/")
    default_port = MOONCAKE_PORT if kind == "mooncake" else REDIS_PORT
    hosts = tuple(_host(part, default_port, shown) for part in hostlist.split(","))
    if kind == "redis" and len(hosts) > 1:
        kind = "cluster"
    db = int(path) if path.isdigit() else 0
    if (path and not path.isdigit()) or (db and kind != "redis"):
        raise ValueError(f"remote store {shown!r}: a database number is for one server only")
    query = tuple(parse_qsl(query_text, strict_parsing=bool(query_text)))
    allowed = _MOONCAKE_KEYS if kind == "mooncake" else set()
    unknown = {k for k, _ in query} - allowed
    if unknown:
        raise ValueError(f"remote store {shown!r}: unknown options {sorted(unknown)}")
    if kind == "mooncake" and len(hosts) != 1:
        raise ValueError(f"remote store {shown!r}: Mooncake has one master address")
    return Endpoint(kind, hosts, tls, db, userinfo or None, query)


@dataclass(frozen=True)
class RemoteConfig:
    """Everything needed to open the remote tier: the store's URL, credentials, TLS files,
    timeouts and the tier's own settings."""

    url: str
    password_file: Path | None = None
    password_env: str = PASSWORD_ENV
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    connect_timeout_s: float = 1.0
    settings: RemoteSettings = field(default_factory=RemoteSettings)

    def __post_init__(self) -> None:
        parse_url(self.url)  # fail at start-up, not at the first block
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be positive")

    @property
    def endpoint(self) -> Endpoint:
        return parse_url(self.url)

    def password(self) -> str | None:
        """The store's password: the file's first line, else the environment variable."""
        if self.password_file is not None:
            return Path(self.password_file).read_text().strip() or None
        return os.environ.get(self.password_env) or None

    def open_backend(self, max_value_bytes: int) -> RemoteBackend:
        """Connects nothing yet; the backend connects on first use and keeps trying."""
        endpoint = self.endpoint
        return _OPENERS[endpoint.kind](self, endpoint, max_value_bytes)

    def open_tier(
        self,
        layout_signature: bytes,
        block_bytes: int,
        hash_version: int = HASH_VERSION,
        *,
        counters: TierCounters | None = None,
        on_event: Callable[[str, bytes, bytes], None] | None = None,
    ) -> RemoteTier:
        """The remote tier of one layout, its keys in that layout's namespace."""
        backend = self.open_backend(value_size(block_bytes, MAX_META_BYTES))
        return RemoteTier(
            backend,
            layout_signature,
            block_bytes,
            key_prefix(layout_signature, hash_version),
            self.settings,
            counters=counters,
            on_event=on_event,
        )


def _host(text: str, default_port: int, shown: str) -> tuple[str, int]:
    """``(host, port)`` of ``text``; ``shown`` is the URL as errors name it (redacted)."""
    match = _HOST.match(text.strip())
    if match is None:
        raise ValueError(f"remote store {shown!r}: not a host[:port]: {text!r}")
    port = int(match.group("port") or default_port)
    if not 0 < port < 65536:
        raise ValueError(f"remote store {shown!r}: port {port} out of range")
    return match.group("v6") or match.group("name"), port


def _redis_options(config: RemoteConfig, endpoint: Endpoint) -> RedisOptions:
    # redis-py is imported only where a Redis store is configured: its import is about 0.4 s
    # of every daemon start, and a daemon restarting under live engines serves nobody meanwhile.
    from kvtier.tiers.remote.redis import RedisOptions

    return RedisOptions(
        username=endpoint.username,
        password=config.password(),
        tls=endpoint.tls,
        ca_file=str(config.ca_file) if config.ca_file else None,
        cert_file=str(config.cert_file) if config.cert_file else None,
        key_file=str(config.key_file) if config.key_file else None,
        connect_timeout_s=config.connect_timeout_s,
        # A socket read or write never outlasts the tier's longest wait by much.
        socket_timeout_s=config.settings.transfer_timeout_s,
        connections=config.settings.connections,
    )


def _open_redis(config: RemoteConfig, endpoint: Endpoint, _: int) -> RemoteBackend:
    from kvtier.tiers.remote.redis import RedisStandalone

    (host, port), options = endpoint.hosts[0], _redis_options(config, endpoint)
    return RedisStandalone(host, port, endpoint.db, options)


def _open_cluster(config: RemoteConfig, endpoint: Endpoint, _: int) -> RemoteBackend:
    from kvtier.tiers.remote.redis import RedisClusterBackend

    return RedisClusterBackend(endpoint.hosts, _redis_options(config, endpoint))


def _open_mooncake(config: RemoteConfig, endpoint: Endpoint, max_value_bytes: int) -> RemoteBackend:
    (host, port), query = endpoint.hosts[0], dict(endpoint.query)
    options = MooncakeOptions(
        metadata_server=query.get("metadata", f"http://{host}:8080/metadata"),
        local_host=query.get("local_host") or socket.gethostbyname(socket.gethostname()),
        segment_bytes=_int(query.get("segment", "0"), "segment"),
        buffer_bytes=_int(query.get("buffer", str(128 << 20)), "buffer"),
        protocol=query.get("protocol", "tcp"),
    )
    return MooncakeBackend(f"{host}:{port}", options, max_value_bytes)


def _int(text: str, name: str) -> int:
    if not text.isdigit():
        raise ValueError(f"Mooncake option {name}={text!r}: give a byte count")
    return int(text)


_OPENERS: dict[str, Callable[[RemoteConfig, Endpoint, int], RemoteBackend]] = {
    "redis": _open_redis,
    "cluster": _open_cluster,
    "mooncake": _open_mooncake,
}
