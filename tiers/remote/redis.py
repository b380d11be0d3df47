"""Valkey/Redis as the remote tier's store: one server, or a cluster of them.

Client: redis-py with hiredis. It is the client Redis itself maintains, speaks to Valkey
unchanged, is thread-safe with a connection pool per server, knows the cluster's slot map and
how to rediscover it, and parses replies in C (hiredis) at the speed of the socket. valkey-py is
a fork of the same code; valkey-glide routes every call through a Rust core and an extra copy of
each value, and its Python API gives no control over pipelines per node, which is what this
tier needs. One thing is changed from the defaults: requests are packed by redis-py's own
Python serializer, which hands a large value to the socket as it is, where the hiredis packer
copies each 2 MiB value twice into one request buffer (replies are still parsed by hiredis).
It is extended by one case: a value given as ``Parts`` (the header, and the payload where the
caller keeps it) goes out as one bulk string written from its buffers in turn, so a block is
never copied on this side of the socket either.

Cluster: a route is a primary; its keys go to it as one pipeline (``EXISTS``/``GET``/``SET`` per
key, no transaction), on that primary's own connection pool, so a slow node ties up only
connections of its own. The slot map comes from the seeds the first time the cluster is used,
not at construction (a daemon starts while its store is down); until then every key is on the
``SEEDS`` route, whose calls try to reach the cluster. An error that may mean the map moved
(a lost node, ``MOVED``, ``CLUSTERDOWN``) marks the map stale and the next ``ping`` relearns it.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, Encoder, PythonRespSerializer, SSLConnection
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError
from redis.retry import Retry

from kvtier.tiers.remote.backend import RemoteBackend, RemoteError, RouteGone

log = logging.getLogger(__name__)

SEEDS = "seeds"
"""The route of every key while a cluster's slot map is not known yet."""


class Parts(tuple):
    """One command argument sent as the concatenation of these buffers (none is copied)."""

    __slots__ = ()


class _Packer(PythonRespSerializer):
    """redis-py's serializer, plus ``Parts`` arguments: framed as one bulk string (RESP's
    ``$<length>``), each buffer handed to the socket as it is."""

    def pack(self, *args: Any) -> list[Any]:
        if not any(isinstance(arg, Parts) for arg in args):
            return super().pack(*args)
        output: list[Any] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, Parts):
                views = [memoryview(part).cast("B") for part in arg]
                output.append(b"$%d\r\n" % sum(v.nbytes for v in views))
                output.extend(views)
            else:
                value = self.encode(arg)
                output += [b"$%d\r\n" % len(value), value]
            output.append(b"\r\n")
        return output


# It keeps no state (6000 B is redis-py's own cut-off between joining an argument into the
# request and sending it on its own).
_PACKER = _Packer(6000, Encoder("utf-8", "strict", False).encode)
# Errors after which a cluster's slot map may be out of date.
_TOPOLOGY_ERRORS = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


class _Connection(Connection):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(command_packer=_PACKER, **kwargs)


class _TlsConnection(SSLConnection):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(command_packer=_PACKER, **kwargs)


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """How to reach the servers; ``password`` is never logged."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    connect_timeout_s: float = 1.0
    socket_timeout_s: float = 5.0
    """Bounds each read or write on a socket, so a call stuck on a dead peer ends."""
    connections: int = 4
    """Connections kept per server (the tier runs as many calls per route at once)."""

    def connection_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "username": self.username,
            "password": self.password,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_timeout": self.socket_timeout_s,
            "socket_keepalive": True,
            "client_name": "kvtier",
            "retry": Retry(NoBackoff(), 0),  # the tier's breaker decides when to try again
        }
        if self.tls:
            kwargs |= {
                "ssl_ca_certs": self.ca_file,
                "ssl_certfile": self.cert_file,
                "ssl_keyfile": self.key_file,
            }
        return kwargs


class RedisBackend(RemoteBackend):
    """Pipelined batches on one server's connection pool per route (see ``RedisStandalone``
    and ``RedisClusterBackend`` for where the routes come from)."""

    @abstractmethod
    def _client(self, route: str) -> redis.Redis:
        """The client of the server that ``route`` names."""

    def _failed(self, route: str, error: BaseException) -> RemoteError:
        """The error to raise for a failed call on ``route`` (a hook for topology changes)."""
        return RemoteError(f"{self.name} {route}: {error}")

    def exists(self, route: str, keys: Sequence[bytes]) -> list[bool]:
        return [bool(n) for n in self._pipeline(route, "EXISTS", [(k,) for k in keys])]

    def get(self, route: str, keys: Sequence[bytes]) -> list[Any | None]:
        return self._pipeline(route, "GET", [(k,) for k in keys])

    def put(self, route: str, items: Sequence[tuple[bytes, Sequence[Any]]]) -> list[bool]:
        args = [(key, Parts(parts)) for key, parts in items]
        replies = self._pipeline(route, "SET", args, per_key_errors=True)
        return [reply is True for reply in replies]

    def delete(self, route: str, keys: Sequence[bytes]) -> None:
        self._pipeline(route, "UNLINK", [(k,) for k in keys])

    def ping(self, route: str) -> None:
        try:
            self._client(route).ping()
        except (redis.RedisError, OSError) as exc:
            raise self._failed(route, exc) from exc

    def _pipeline(
        self,
        route: str,
        command: str,
        args: Sequence[tuple[Any, ...]],
        *,
        per_key_errors: bool = False,
    ) -> list[Any]:
        """Sends one command per ``args`` entry in one round trip; returns the replies.

        An error reply fails the whole call unless ``per_key_errors`` (then it is returned in
        its place: a write the server refused, such as one over ``maxmemory``).
        """
        try:
            pipe = self._client(route).pipeline(transaction=False)
            for a in args:
                pipe.execute_command(command, *a)
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(route, exc) from exc
        for reply in replies:
            if isinstance(reply, ResponseError):
                if not per_key_errors or str(reply).startswith(_TOPOLOGY_ERRORS):
                    raise self._failed(route, reply)
                log.warning("%s %s: %s refused: %s", self.name, route, command, reply)
        return replies


class RedisStandalone(RedisBackend):
    """One server (or a proxy in front of many): a single route."""

    def __init__(self, host: str, port: int, db: int = 0, options: RedisOptions | None = None):
        options = options or RedisOptions()
        self.name = f"{'rediss' if options.tls else 'redis'}://{host}:{port}/{db}"
        self._route = f"{host}:{port}"
        pool = redis.ConnectionPool(
            host=host,
            port=port,
            db=db,
            connection_class=_TlsConnection if options.tls else _Connection,
            max_connections=options.connections + 2,  # + the write-behind batch and a probe
            **options.connection_kwargs(),
        )
        self._redis = redis.Redis(connection_pool=pool)

    def routes(self, keys: Sequence[bytes]) -> list[str]:
        return [self._route] * len(keys)

    def _client(self, route: str) -> redis.Redis:
        if route != self._route:
            raise RouteGone(f"{self.name} has no route {route}")
        return self._redis

    def close(self) -> None:
        self._redis.close()
        self._redis.connection_pool.disconnect()


class RedisClusterBackend(RedisBackend):
    """A Redis/Valkey cluster: a route per primary, learnt from the seeds on first use."""

    def __init__(self, seeds: Sequence[tuple[str, int]], options: RedisOptions | None = None):
        if not seeds:
            raise ValueError("a cluster needs at least one seed host:port")
        options = options or RedisOptions()
        scheme = "rediss" if options.tls else "redis"
        self.name = f"{scheme}+cluster://{','.join(f'{h}:{p}' for h, p in seeds)}"
        # redis-py builds a node's client from a connection class only for a cluster given by
        # URL; the first seed is given so, the others as startup nodes.
        host, port = seeds[0]
        self._url = f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}"
        self._seeds = [ClusterNode(h, p) for h, p in seeds[1:]]
        kwargs = options.connection_kwargs()
        kwargs.pop("retry")  # the cluster client gives its node clients no retries of their own
        self._kwargs = kwargs | {
            "connection_class": _TlsConnection if options.tls else _Connection,
            "max_connections": options.connections + 2,
        }
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        self._stale = False
        self._closed = False
        try:
            self._discover()
        except RemoteError as exc:
            log.warning("%s: not reachable yet, will keep trying: %s", self.name, exc)

    def routes(self, keys: Sequence[bytes]) -> list[str]:
        cluster = self._cluster
        if cluster is None:
            return [SEEDS] * len(keys)
        slots = cluster.nodes_manager.slots_cache
        routes = []
        for key in keys:
            nodes = slots.get(key_slot(key))
            routes.append(nodes[0].name if nodes else SEEDS)
        return routes

    def ping(self, route: str) -> None:
        if self._stale or self._cluster is None or route == SEEDS:
            self._discover()
            if route == SEEDS:
                raise RouteGone("the cluster's slot map is known now")
        if route not in {node.name for node in self._cluster.get_primaries()}:
            raise RouteGone(f"{route} is no longer a primary of {self.name}")
        super().ping(route)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._cluster is not None:
                self._cluster.close()

    def _client(self, route: str) -> redis.Redis:
        if route == SEEDS:
            self._discover()
            raise RouteGone(f"{self.name}: the slot map is known now, route again")
        node = self._cluster.get_node(node_name=route)
        if node is None:
            raise RouteGone(f"{route} is no longer a node of {self.name}")
        return self._cluster.get_redis_connection(node)

    def _failed(self, route: str, error: BaseException) -> RemoteError:
        # Any failure may be a node lost or a slot moved: relearn the map at the next ping.
        self._stale = True
        return super()._failed(route, error)

    def _discover(self) -> None:
        """Learns (or relearns) the slot map from the seeds and the nodes known so far."""
        with self._lock:
            if self._closed:
                raise RemoteError(f"{self.name} is closed")
            try:
                if self._cluster is None:
                    self._cluster = RedisCluster(
                        url=self._url,
                        startup_nodes=list(self._seeds),
                        require_full_coverage=False,
                        retry=Retry(NoBackoff(), 0),
                        **self._kwargs,
                    )
                else:
                    self._cluster.nodes_manager.initialize()
            # redis-py raises IndexError where the seeds answer but serve no slot yet.
            except (redis.RedisError, RedisClusterException, OSError, IndexError) as exc:
                raise RemoteError(f"{self.name}: no usable seed: {exc!r}") from exc
            self._stale = False
        log.info("%s: %d primaries", self.name, len(self._cluster.get_primaries()))
