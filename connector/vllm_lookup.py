"""Lookups of a request's blocks that never make vLLM's scheduler wait.

A ``Lookup`` asks the daemon, for every tensor-parallel rank at once and without waiting,
how many of blocks ``[start, end)`` of one request it holds. The scheduler keeps one per
request and asks again only when the question changes (vLLM's own GPU hit moved ``start``,
or the request's tokens moved ``end``); until the answers are in it tells vLLM to ask later.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from kvtier.connector.client import DaemonClient
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host import LowerHits


@dataclass(slots=True, eq=False)
class Lookup:
    """The daemon's answers about blocks ``[start, end)`` of one request, one per rank."""

    start: int
    end: int
    answers: list[Future[LowerHits]]
    asked_at: float = field(default_factory=time.monotonic)

    @classmethod
    def ask(
        cls, client: DaemonClient, per_rank: list[list[BlockHash]], start: int, end: int
    ) -> Lookup:
        """Asks about ``per_rank[r]``, rank r's hashes of blocks ``[start, end)``."""
        return cls(start, end, [client.lookup_async(hashes) for hashes in per_rank])

    def stale(self, hold_s: float) -> bool:
        """Whether the answer is older than half the daemon holds a lookup's host hits: the
        daemon may have let them go, so ask again rather than promise them to vLLM."""
        return hold_s > 0 and self.done() and time.monotonic() - self.asked_at > hold_s / 2

    def done(self) -> bool:
        return all(answer.done() for answer in self.answers)

    def hits(self) -> LowerHits:
        """What every rank holds: the shortest rank's prefix, split by tier as rank 0 holds it
        (vLLM counts each token once, whatever the number of ranks)."""
        per_rank = [answer.result() for answer in self.answers]
        total = min(hits.total for hits in per_rank)
        first = per_rank[0]
        host = min(first.host, total)
        disk = min(first.disk, total - host)
        return LowerHits(host=host, disk=disk, remote=total - host - disk)


class Lookups:
    """The lookups still in flight, for counting and for tests that wait for the daemon."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: set[Lookup] = set()

    def add(self, lookup: Lookup) -> None:
        self._pending.add(lookup)

    def discard(self, lookup: Lookup | None) -> None:
        self._pending.discard(lookup)

    def clear(self) -> None:
        self._pending.clear()

    def in_flight(self) -> int:
        self._pending = {lookup for lookup in self._pending if not lookup.done()}
        return len(self._pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every lookup in flight is answered (or ``timeout``); True if all are."""
        answers = [answer for lookup in self._pending for answer in lookup.answers]
        return not wait(answers, timeout=timeout).not_done
