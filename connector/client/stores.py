"""The daemon client's stores: Reserve, Commit and Abort, with slots reserved ahead.

A store takes its slots from those its session holds reserved ahead where there are enough
(``ahead``: no round trip), else reserves them by hash. Its Commit names the slots taken ahead
with their hashes; it waits for the daemon (``commit``) or not (``commit_later``, whose answer
comes to a callback). Commits go in chunks of ``chunk_blocks``, a failed chunk costing that
chunk only: its slots are aborted (a late commit may have landed after all; its abort is then
refused, which is as good).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from itertools import count
from typing import Protocol

import grpc
import numpy as np

from kvtier.connector.client.ahead import ReservedAhead
from kvtier.connector.client.circuit import CircuitBreaker
from kvtier.connector.client.later import LaterCalls
from kvtier.connector.client.lookups import LookupCalls
from kvtier.connector.client.session import SessionKeeper, SlotLedger
from kvtier.connector.client.slot_stream import SlotCalls
from kvtier.connector.client.wire import meta_chunks, pack_hashes
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.lower import ALREADY_STORED, NO_SPACE

log = logging.getLogger(__name__)

Committed = Callable[[bool, int], None]
"""Hears how a commit sent without waiting went: whether every block of it was committed,
and how many of its blocks were not stored (a tier held them already)."""


class Client(Protocol):
    """What the stores use of their ``DaemonClient``."""

    failures: int
    counters: TierCounters
    breaker: CircuitBreaker
    slot_calls: SlotCalls
    timeout_s: float
    reserves_ahead: bool
    chunk_blocks: int
    _lock: threading.Lock
    _ledger: SlotLedger
    _keeper: SessionKeeper
    _later: LaterCalls
    _lookups: LookupCalls
    _call_ids: count

    def _usable(self, counts: bool) -> str | None: ...
    def _failed(self, method: str, exc: grpc.RpcError, session: str | None, repair=None): ...
    def _finish(self, method: str, slots: Sequence[int], take: Callable) -> None: ...


class StoreCalls:
    """``DaemonClient``'s ``reserve``, ``commit``, ``commit_later`` and ``abort``."""

    def __init__(self, client: Client):
        self._client = client
        self._outbox = Outbox()
        self._answered = threading.Condition()
        self._unanswered = 0
        """Commits sent without waiting whose ``then`` has not run yet."""
        self.ahead = ReservedAhead(
            client.slot_calls,
            client._lock,
            client._ledger,
            client._later,
            client._call_ids,
            client._failed,
            client.timeout_s,
            self._outbox.put,
        )

    def settle(self, timeout: float | None) -> bool:
        """Waits until every commit sent without waiting has been answered and told its
        ``then``, and the Reserve for more slots ahead too; False after ``timeout``."""
        with self._answered:
            if not self._answered.wait_for(lambda: not self._unanswered, timeout):
                return False
        return self._outbox.drain(timeout) and self.ahead.settle(timeout)

    def close(self) -> None:
        self._outbox.close()

    def reserve(self, hashes: Sequence[BlockHash], metas: Sequence[bytes] | None) -> list[int]:
        c = self._client
        slots = [NO_SPACE] * len(hashes)
        session = c._usable(bool(hashes))
        if session is None:
            return slots
        limits = c._keeper.limits
        ahead = limits.reserve_ahead if c.reserves_ahead else 0
        taken = self._take_ahead(session, hashes, metas, ahead) if ahead else None
        if taken is not None:
            return taken
        if not c._later.settle_for_next(c.timeout_s):
            return slots
        room = max(0, limits.max_reserved - len(c._ledger.reserved))
        for start, end in meta_chunks(hashes[:room], metas, limits.max_hashes):
            call_id = next(c._call_ids)
            request = pb.ReserveRequest(
                session_id=session,
                hashes=pack_hashes(hashes[start:end]),
                metas=metas[start:end] if metas else (),
                call_id=call_id,
            )
            try:
                reply = c.slot_calls.call("Reserve", request, c.timeout_s)
            except grpc.RpcError as exc:
                repair = c._later.canceller(session, call_id)
                c._failed("Reserve", exc, session, repair=repair)
                break
            with c._lock:
                if c._keeper.session != session:
                    break  # the session ended; the daemon aborted these
                c._ledger.reserved.update(s for s in reply.slots if s >= 0)
            slots[start:end] = reply.slots
        return slots

    def _take_ahead(
        self, session: str, hashes: Sequence[BlockHash], metas: Sequence[bytes] | None, ahead: int
    ) -> list[int] | None:
        """``reserve`` from the slots reserved ahead, or None. Where the client reads the
        daemon's lookup index, a block it says a tier holds is ``ALREADY_STORED`` and takes
        no slot (not copied); one stored since is copied and then freed by its Commit."""
        held = self._client._lookups.held(session, hashes)
        if held is None or not held.any():
            return self.ahead.take(session, hashes, metas, ahead)
        fresh = np.flatnonzero(held == 0).tolist()
        slots = [ALREADY_STORED] * len(hashes)
        if fresh:
            taken = self.ahead.take(
                session,
                [hashes[i] for i in fresh],
                [metas[i] for i in fresh] if metas else None,
                ahead,
            )
            if taken is None:
                return None
            for i, slot in zip(fresh, taken, strict=True):
                slots[i] = slot
        return slots

    def commit(self, slots: Sequence[int]) -> bool:
        if not slots:
            return True
        session = self._take(slots)
        if session is None:
            self._client.failures += 1
            return False
        requests = self._requests(session, slots)
        return all([self._commit_chunk(session, request) for request in requests])

    def commit_later(self, slots: Sequence[int], then: Committed | None) -> None:
        c = self._client
        if not slots:
            if then is not None:
                then(True, 0)
            return
        session = self._take(slots)
        if session is None:
            c.failures += 1
            if then is not None:
                then(False, 0)
            return
        with self._answered:
            self._unanswered += 1
        # The requests are made on the sender thread too: right after a store's copies the
        # caller's caches are cold, and each step costs it several times its warm cost.
        self._outbox.put(partial(self._send_commits, session, list(slots), then))

    def _send_commits(self, session: str, slots: list[int], then: Committed | None) -> None:
        c = self._client
        requests = self._requests(session, slots)
        outcome = _Outcome(len(requests), c.counters, partial(self._told, then))
        for request in requests:
            if not c.breaker.allow():
                c.failures += 1
                c._later.send("Abort", session, list(request.slots), tolerate_gone=True)
                outcome.add(False, 0)
            else:
                c._later.commit(session, request, outcome.add)

    def _told(self, then: Committed | None, ok: bool, not_stored: int) -> None:
        try:
            if then is not None:
                then(ok, not_stored)
        finally:
            with self._answered:
                self._unanswered -= 1
                self._answered.notify_all()

    def abort(self, slots: Sequence[int]) -> None:
        def take(slots: Sequence[int]) -> None:
            self._client._ledger.take_reserved(slots)
            self.ahead.names(slots)

        self._client._finish("Abort", slots, take)

    def _take(self, slots: Sequence[int]) -> str | None:
        """Takes ``slots`` out of the ledger (committed or failed, they are the daemon's from
        now on); returns the live session, or None (and their names are forgotten)."""
        c = self._client
        with c._lock:
            c._ledger.take_reserved(slots)
            session = c._keeper.session
            if session is None:
                self.ahead.names(slots)
        return session

    def _requests(self, session: str, slots: Sequence[int]) -> list[pb.SlotsRequest]:
        """The Commit requests of ``slots``, in chunks, those taken ahead with their names."""
        c = self._client
        with c._lock:
            names = self.ahead.names(slots)
        step = c.chunk_blocks
        requests = []
        for group in ([s for s in slots if s not in names], [s for s in slots if s in names]):
            for start in range(0, len(group), step):
                chunk = group[start : start + step]
                request = pb.SlotsRequest(session_id=session, slots=chunk)
                if chunk[0] in names:
                    request.hashes = pack_hashes([names[s][0] for s in chunk])
                    metas = [names[s][1] for s in chunk]
                    if any(metas):
                        request.metas.extend(metas)
                requests.append(request)
        return requests

    def _commit_chunk(self, session: str, request: pb.SlotsRequest) -> bool:
        # Commit is bookkeeping (the disk writes happen behind it): its deadline does not
        # grow with the chunk's bytes.
        c = self._client
        if c._keeper.session != session:
            return False  # the session ended; the daemon aborted its reserved slots
        chunk = list(request.slots)
        if not c.breaker.allow():
            c.failures += 1
            c._later.send("Abort", session, chunk, tolerate_gone=True)
            return False
        try:
            reply = c.slot_calls.call("Commit", request, c.timeout_s)
        except grpc.RpcError as exc:
            repair = partial(c._later.send, "Abort", session, chunk, tolerate_gone=True)
            c._failed("Commit", exc, session, repair=repair)
            return False
        c.counters.blocks_deduplicated += reply.not_stored
        return True


class _Outcome:
    """Gathers a commit's chunks' answers (on whichever threads they come) for its ``then``."""

    def __init__(self, chunks: int, counters: TierCounters, then: Committed | None):
        self._lock = threading.Lock()
        self._left = chunks
        self._ok = True
        self._not_stored = 0
        self._counters = counters
        self._then = then

    def add(self, ok: bool, not_stored: int) -> None:
        with self._lock:
            self._ok &= ok
            self._not_stored += not_stored
            self._counters.blocks_deduplicated += not_stored
            self._left -= 1
            done = not self._left
        if done and self._then is not None:
            self._then(self._ok, self._not_stored)


class Outbox:
    """Sends what stores hand over, in order, on a thread of its own.

    A store's caller is an engine's thread. After an idle pause a send costs it 0.1-0.2 ms on
    the 2-core VM (the kernel wakes the daemon's thread on the way), handing the send to this
    thread a fraction of that; the answers come to callbacks either way."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._waiting = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, send: Callable[[], None]) -> None:
        with self._idle:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvtier-store-calls", daemon=True
                )
                self._thread.start()
            self._waiting += 1
        self._queue.put(send)

    def drain(self, timeout: float | None) -> bool:
        """Waits until everything handed over has been sent; False after ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._waiting, timeout)

    def close(self) -> None:
        """Sends what was handed over, then stops."""
        with self._idle:
            thread, self._closed = self._thread, True
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while (send := self._queue.get()) is not None:
            try:
                send()
            except Exception:  # a send's own failures are counted by it; this one is a bug
                log.exception("kvtier: a store's call could not be sent")
            finally:
                with self._idle:
                    self._waiting -= 1
                    self._idle.notify_all()
