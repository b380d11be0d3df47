"""The contract between the remote tier and a store it can use.

A backend is a key-value store reached over the network, in batches, with four primitives:

* ``exists(route, keys)``: which keys the store holds;
* ``get(route, keys)``: their values (None for an absent key);
* ``put(route, items)``: stores ``(key, parts)`` pairs, a value sent as the concatenation of
  its parts (a header and a payload, neither copied into one buffer), reporting each;
* ``delete(route, keys)``: forgets keys (a value found corrupt).

Keys are ASCII bytes; values are opaque byte strings (``format`` gives them meaning).
A store may be spread over several endpoints (a Redis cluster's primaries): ``routes`` names the
endpoint serving each key and every primitive works on one endpoint at a time, so the tier can
run endpoints in parallel and cut off a failing one (its circuit breaker) without touching the
others. A single server has one route.

Every primitive may block up to the backend's own socket timeouts and raises ``RemoteError``
for anything the store or the network did wrong; the tier bounds the wait and turns errors into
counted misses. Methods are called from several threads at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class RemoteError(Exception):
    """The store did not answer, or answered with an error."""


class RouteGone(RemoteError):
    """The route no longer exists (the cluster's topology changed); forget it."""


class RemoteBackend(ABC):
    """Batched access to a shared key-value store; see the module docstring."""

    name: str
    """Where the store is, for logs (never includes credentials)."""

    @abstractmethod
    def routes(self, keys: Sequence[bytes]) -> list[str]:
        """The route of each key. Raises ``RemoteError`` when no endpoint can be found."""

    @abstractmethod
    def exists(self, route: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each key."""

    @abstractmethod
    def get(self, route: str, keys: Sequence[bytes]) -> list[Any | None]:
        """Each key's value as a buffer, or None where the store holds no such key.

        A value may live in a buffer of the backend's: it stays valid until the calling
        thread's next ``get``.
        """

    @abstractmethod
    def put(self, route: str, items: Sequence[tuple[bytes, Sequence[Any]]]) -> list[bool]:
        """Stores each key with the concatenation of its buffers as the value; True where the
        store took it. The buffers are only read during the call."""

    @abstractmethod
    def delete(self, route: str, keys: Sequence[bytes]) -> None:
        """Removes the keys (absent ones are no error)."""

    @abstractmethod
    def ping(self, route: str) -> None:
        """Returns if the route answers now; ``RouteGone`` if it no longer exists."""

    @abstractmethod
    def close(self) -> None:
        """Closes every connection (idempotent)."""
