"""Async loads streamed through the host tier, a chunk at a time.

A request's hit may be larger than the host slots one session may hold at once (or than the
whole host tier, when most of it is on disk). So an async load is not acquired in one piece:
it asks for one chunk (at most the client's chunk size, and never more than the session has
room for), copies it into vLLM's blocks when the daemon answers, releases the slots once the
copy has read them, and only then asks for the next chunk. A chunk answered short (a block
gone since the lookup, a checksum miss, a daemon in trouble) ends the load there: the blocks
from that point are load errors, and vLLM recomputes them.

Every step happens on the engine's thread (``advance``), except the ``Acquire`` round trips,
which run on a helper thread; nothing here waits.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.connector.tunables import TUNABLES
from kvtier.connector.vllm.metadata import LoadSpec
from kvtier.tiers.gpu.transfer import Transfer

Acquire = Callable[[list[bytes]], Future[list[int]]]
"""Starts an ``Acquire`` of these hashes on the helper thread."""
Copy = Callable[[list[int], list[int]], Transfer]
"""Starts the copy of these slots into these vLLM block ids; its callback releases them."""
Fail = Callable[[LoadSpec, list[int]], None]
"""Reports these block ids of the load as not loadable."""
Step = Callable[["StreamedLoad", int], None]
"""Advances one load, given the slots its session's acquires on their way will take."""


log = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamedLoad:
    """One async load in progress: blocks before ``next`` are acquired (copied or copying)."""

    spec: LoadSpec
    hashes: list[bytes]
    next: int = 0
    asked: int = 0
    acquiring: Future[list[int]] | None = None
    copying: Transfer | None = None
    failed: bool = False
    starved_since: float | None = None

    @property
    def landed(self) -> bool:
        """Every block copied in, or failed; nothing of it in flight any more."""
        idle = self.acquiring is None and self.copying is None
        return idle and (self.failed or self.next >= len(self.hashes))

    def advance(
        self,
        acquire: Acquire,
        copy: Copy,
        fail: Fail,
        room: int,
        chunk: int,
        now: float | None = None,
    ) -> None:
        """Moves the load on as far as it can go now; ``room`` is how many more slots the
        session may hold, ``chunk`` the most to ask for at once, ``now`` the monotonic time."""
        now = time.monotonic() if now is None else now
        if self.copying is not None:
            if not self.copying.done():
                return
            self.copying = None
        if self.acquiring is not None:
            if not self.acquiring.done():
                return
            slots, self.acquiring = self.acquiring.result(), None
            start = self.next
            if slots:
                self.copying = copy(slots, self.spec.block_ids[start : start + len(slots)])
            self.next += len(slots)
            if len(slots) < self.asked:
                self._fail_rest(fail)
        if self.copying is None and not self.landed:
            want = min(len(self.hashes) - self.next, room, chunk)
            if want > 0:
                self.starved_since = None
                self.asked = want
                self.acquiring = acquire(self.hashes[self.next : self.next + want])
            else:  # the session's slots are all held now: ask again next step
                self._starved(fail, now)

    def _starved(self, fail: Fail, now: float) -> None:
        if self.starved_since is None:
            self.starved_since = now
        elif now - self.starved_since >= TUNABLES.starved_load_s:
            log.warning(
                "kvtier: no room to load %s for %.0f s; recomputing its last %d blocks",
                self.spec.req_id,
                now - self.starved_since,
                len(self.hashes) - self.next,
            )
            self._fail_rest(fail)

    def give_up(self, release: Callable[[list[int]], None], fail: Fail) -> None:
        """Ends the load where it stands, once its copies have landed: slots acquired and not
        copied go back, and the blocks not copied are failed."""
        self.abandon(release)
        self.copying = None
        if not self.landed:
            self._fail_rest(fail)

    def _fail_rest(self, fail: Fail) -> None:
        """Fails the blocks not copied yet: vLLM recomputes them."""
        self.failed = True
        fail(self.spec, self.spec.block_ids[self.next :])

    def abandon(self, release: Callable[[list[int]], None]) -> None:
        """At shutdown: gives back the slots of an acquire that has not been copied."""
        if self.acquiring is not None:
            release(self.acquiring.result())
            self.acquiring = None


class InFlight:
    """The slots each session's acquires still on their way will take, kept up to date as
    the loads advance one after another.

    Without it two loads advanced in one step would both ask for the same room, and the later
    be answered short (its blocks recomputed). Summed once per step and then adjusted per
    load, so a step looks at each load a bounded number of times however many wait (summing
    again for every load costs the square of their number, every step). An acquire answered
    after it was counted stays counted until its load is advanced: such a load asks less
    this step, never too much.
    """

    def __init__(self, loads: Iterable[StreamedLoad], session: Callable[[StreamedLoad], Hashable]):
        self._session = session
        self._slots: Counter[Hashable] = Counter()
        self._counted: dict[int, tuple[Future[list[int]], int]] = {}
        for load in loads:
            acquiring = load.acquiring
            if acquiring is not None and not acquiring.done():
                self._slots[session(load)] += load.asked
                self._counted[id(load)] = (acquiring, load.asked)

    def advance(self, load: StreamedLoad, step: Step) -> None:
        """Advances ``load`` through ``step`` and counts what it asked for or got."""
        session = self._session(load)
        counted = self._counted.pop(id(load), None)
        step(load, self._slots[session])
        acquiring = load.acquiring
        if counted is not None:
            if acquiring is counted[0]:
                self._counted[id(load)] = counted
                return
            self._slots[session] -= counted[1]
        if acquiring is not None and not acquiring.done():
            self._slots[session] += load.asked
            self._counted[id(load)] = (acquiring, load.asked)
