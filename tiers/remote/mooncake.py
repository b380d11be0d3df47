"""Mooncake Store as the remote tier's store, over its TCP transport.

Mooncake Store (``mooncake-transfer-engine``; ``mooncake-transfer-engine-non-cuda`` on a machine
without CUDA, same module) keeps objects in memory segments that its clients mount, placed and
evicted by a master service. kvtier joins as a client that mounts no segment by default (the
store's memory belongs to its storage processes, ``mooncake_client``) and keeps one route: the
master decides where each object lives.

Reads go through ``batch_get_into`` into a staging buffer registered with the store, one per
worker thread, because it reports each key on its own: a size, "not found", or an error, where
the simpler calls answer None for both an absent key and a failed transfer. A value is thus
valid until the same thread's next ``get``, which the tier honours (it checks and copies a
value in the call that fetched it). Objects are immutable: a put of a key the store holds
keeps the stored value and reports success.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.tiers.remote.backend import RemoteBackend, RemoteError, RouteGone

log = logging.getLogger(__name__)

_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
_HAS_LEASE = -706  # OBJECT_HAS_LEASE: read moments ago; removal waits for the lease
_NO_ROOM = -200  # NO_AVAILABLE_HANDLE: no mounted segment has room (yet)


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """How this node joins the store (sizes in bytes)."""

    metadata_server: str
    """``http://HOST:PORT/metadata`` (the master's own with ``--enable_http_metadata_server``),
    or ``P2PHANDSHAKE``."""
    local_host: str
    """This node's address as the store's other members reach it."""
    segment_bytes: int = 0
    """Memory this node lends to the store (0: a client only)."""
    buffer_bytes: int = 128 << 20
    """The client's transfer buffer."""
    protocol: str = "tcp"


class MooncakeBackend(RemoteBackend):
    """The Mooncake Store whose master is at ``master`` (``HOST:PORT``).

    ``max_value_bytes`` bounds what one ``get`` can return per key (the tier's largest value);
    the connection is made on first use, so a node starts while the store is down.
    """

    def __init__(self, master: str, options: MooncakeOptions, max_value_bytes: int) -> None:
        self.name = f"mooncake://{master}"
        self._master = master
        self._options = options
        self._max_value_bytes = max_value_bytes
        self._lock = threading.Lock()
        self._store: Any = None
        self._closed = False
        self._local = threading.local()
        self._staging: list[np.ndarray] = []  # every thread's, kept registered until close

    def routes(self, keys: Sequence[bytes]) -> list[str]:
        return [self._master] * len(keys)

    def exists(self, route: str, keys: Sequence[bytes]) -> list[bool]:
        codes = self._connected(route).batch_is_exist(_names(keys))
        if any(code < 0 for code in codes):
            raise RemoteError(f"{self.name}: exists failed: {codes}")
        return [code == 1 for code in codes]

    def get(self, route: str, keys: Sequence[bytes]) -> list[Any | None]:
        store = self._connected(route)
        staging = self._staging_for(store, len(keys))
        size = self._max_value_bytes
        base = staging.ctypes.data
        sizes = store.batch_get_into(
            _names(keys), [base + i * size for i in range(len(keys))], [size] * len(keys)
        )
        values: list[Any | None] = []
        for i, got in enumerate(sizes):
            if got == _NOT_FOUND:
                values.append(None)
            elif got < 0:
                raise RemoteError(f"{self.name}: get failed with {got}")
            else:
                values.append(memoryview(staging)[i * size : i * size + got])
        return values

    def put(self, route: str, items: Sequence[tuple[bytes, Sequence[Any]]]) -> list[bool]:
        store = self._connected(route)
        codes = [store.put_parts(key.decode("ascii"), *parts) for key, parts in items]
        # A store without room answers, so its route is healthy: the block is only dropped.
        faults = [code for code in codes if code < 0 and code != _NO_ROOM]
        if faults and len(faults) == len(codes):
            raise RemoteError(f"{self.name}: puts failed: {codes}")
        for code in faults:
            log.warning("%s: a put failed with %d", self.name, code)
        return [code == 0 for code in codes]

    def delete(self, route: str, keys: Sequence[bytes]) -> None:
        codes = self._connected(route).batch_remove(_names(keys), force=True)
        failed = [c for c in codes if c < 0 and c not in (_NOT_FOUND, _HAS_LEASE)]
        if failed:
            raise RemoteError(f"{self.name}: remove failed: {failed}")

    def ping(self, route: str) -> None:
        # batch_is_exist asks the master; health_check answers 0 with the master gone.
        self.exists(route, [b"kvtier:ping"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def _connected(self, route: str) -> Any:
        if route != self._master:
            raise RouteGone(f"{self.name} has no route {route}")
        with self._lock:
            if self._closed:
                raise RemoteError(f"{self.name} is closed")
            if self._store is None:
                self._store = self._setup()
            return self._store

    def _setup(self) -> Any:
        from mooncake.store import MooncakeDistributedStore  # optional: the mooncake extra

        o = self._options
        store = MooncakeDistributedStore()
        code = store.setup(
            o.local_host,
            o.metadata_server,
            o.segment_bytes,
            o.buffer_bytes,
            o.protocol,
            "",
            self._master,
        )
        if code != 0:
            store.close()
            raise RemoteError(f"{self.name}: setup failed with {code}")
        log.info("%s: joined as %s", self.name, o.local_host)
        return store

    def _staging_for(self, store: Any, count: int) -> np.ndarray:
        """This thread's registered staging buffer, grown to ``count`` values."""
        staging = getattr(self._local, "staging", None)
        need = count * self._max_value_bytes
        if staging is None or staging.nbytes < need:
            staging = np.empty(need, dtype=np.uint8)
            code = store.register_buffer(staging.ctypes.data, staging.nbytes)
            if code != 0:
                raise RemoteError(f"{self.name}: register_buffer failed with {code}")
            with self._lock:
                self._staging.append(staging)
            self._local.staging = staging
        return staging


def _names(keys: Sequence[bytes]) -> list[str]:
    return [key.decode("ascii") for key in keys]
