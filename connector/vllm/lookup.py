"""Lookups of a request's blocks that never make vLLM's scheduler wait.

A ``Lookup`` asks the daemon, for every KV cache group and tensor-parallel shard at once and
without waiting, which of the request's blocks from token ``start`` to ``end`` it holds, and
settles on the longest hit every group can serve (``hits``). The scheduler keeps one
per request and asks again only when the question changes (vLLM's own GPU hit moved
``start``, or the request's tokens moved ``end``); until the answer is in it tells vLLM to
ask later.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.connector.vllm.hits import Ask, Chain, Hit, HitSearch

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(slots=True, eq=False)
class Lookup:
    """The daemon's answer about tokens ``[start, end)`` of one request."""

    start: int
    end: int
    search: HitSearch
    asked_at: float = field(default_factory=time.monotonic)

    @classmethod
    def ask(cls, ask: Ask, chains: Sequence[Chain], start: int, end: int, align: int) -> Lookup:
        """Asks about every chain's blocks in ``[start, end)`` (tokens, multiples of
        ``align``)."""
        return cls(start, end, HitSearch(chains, start, end, align, ask))

    @property
    def answers(self) -> list[Future[Hit]]:
        return [self.search.result]

    def stale(self, hold_s: float) -> bool:
        """Whether the answer is older than half the daemon holds a lookup's host hits: the
        daemon may have let them go, so ask again rather than promise them to vLLM."""
        return hold_s > 0 and self.done() and time.monotonic() - self.asked_at > hold_s / 2

    def done(self) -> bool:
        return self.search.result.done()

    def hits(self) -> Hit:
        """What every group and shard can serve, split by tier as the first full-attention
        group holds it (vLLM counts each token once)."""
        return self.search.result.result()


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
