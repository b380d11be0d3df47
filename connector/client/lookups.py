"""``DaemonClient``'s lookups: a memory read of the daemon's lookup index where it can, a
``Lookup`` call where it must.

The index (``proto.lookup_index``) says which hashes the layout's host and disk tiers hold; a
probe answers a lookup in microseconds without waking the daemon. Its answer is a hint, as a
call's is: the acquire that follows names hashes and the daemon resolves them again. The call
is still made where the probe cannot answer: no index (a client on another host, a daemon not
publishing one), or a miss where a remote tier lies below (the index does not cover it).

A lookup the index answered still reaches the daemon, as a call nobody waits for: the daemon
counts it in its per-tier hit statistics, its host tier marks the hits recently used, its
admission policy sees the hashes looked up, and it holds the host hits for the acquire
(``lookup_hold_s``), all as before. Only the caller no longer waits for the call, nor sends
it: a thread of the client's does (sending a 1,000-hash call costs the sender about 0.2 ms,
four times the probe). The call says how many host hits the probe promised: the daemon holds
no more (the call may arrive after the request's own blocks were stored), and counts those
evicted before it arrived (``holds_missed``), which it could not hold.

The call goes as an operation of the session's slot channel (or ``SlotOps`` stream) where
the daemon says it takes lookups there (``Limits.slot_lookups``): a round trip there costs
about a third of a gRPC call's. It keeps the call's deadline (``SlotCalls.future``'s
``polled``), and a lookup of more than one chunk stays a call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc
import numpy as np

from kvtier.connector.client.index_reader import LookupIndexReader, start_loading_probe
from kvtier.connector.client.session import SessionKeeper
from kvtier.connector.client.slot_stream import SlotCalls
from kvtier.connector.client.wire import pack_hashes
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.proto.contract import HASH_BYTES
from kvtier.proto.lookup_index import HOST, index_path
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.lower import LowerHits

Failed = Callable[[str, grpc.RpcError, str | None], None]
Notice = tuple[str, bytes, int, np.ndarray | None]
"""A lookup the index answered: session, its hashes packed end to end, the host hits the probe
found, and the tier bits it read for each hash (kept only for a lookup of several calls)."""


def _unheard(hits: LowerHits) -> None:
    """Where a notice's answer goes: the caller had the index's."""


class LookupCalls:
    def __init__(
        self,
        stub: pb_grpc.KvTierStub,
        slot_calls: SlotCalls,
        keeper: SessionKeeper,
        lock: threading.Lock,
        failed: Failed,
        *,
        metadata,
        timeout_s: float,
        index_of: tuple[str, bytes] | None,
    ):
        """``failed(method, error, session)`` counts a failed call and opens the breaker;
        ``index_of`` is the daemon's socket and the layout signature whose index to probe
        (None: a daemon on another host, or probing not wanted)."""
        self._stub = stub
        self._slot_calls = slot_calls
        self._keeper = keeper
        self._lock = lock
        self._failed = failed
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._use_index = index_of is not None
        self._socket, self._signature = index_of or ("", b"")
        self._calls: set[grpc.Future] = set()  # Lookup calls not answered yet
        self._index: LookupIndexReader | None = None
        self._index_session: str | None = None
        self._notices: queue.SimpleQueue[Notice | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._closed = False
        self.probed = 0
        """Lookups the index answered without a call."""
        if self._use_index:
            start_loading_probe()

    def ask(self, session: str | None, hashes: Sequence[BlockHash]) -> Future[LowerHits]:
        """The prefix of ``hashes`` the daemon's tiers hold (none without a ``session``); the
        future never raises."""
        result: Future[LowerHits] = Future()
        self.ask_then(session, hashes, result.set_result)
        return result

    def ask_then(
        self, session: str | None, hashes: Sequence[BlockHash], then: Callable[[LowerHits], None]
    ) -> None:
        """``ask``'s answer handed to ``then``, with no future made: here and at once where
        the index gives it, else when the call's answer arrives (on the client's thread it
        lands on, or here where it lands first). (After a paced client's idle pause a future
        took 35 to 50 µs to make on the 2-core VM.)"""
        found = self._from_index(session, hashes)
        if isinstance(found, LowerHits):
            then(found)
        else:
            self._call(session, found, 0, LowerHits(), then)

    def answer(self, session: str | None, hashes: Sequence[BlockHash]) -> LowerHits:
        """``ask``'s answer, waited for (a future made only where a call must answer)."""
        found = self._from_index(session, hashes)
        if isinstance(found, LowerHits):
            return found
        result: Future[LowerHits] = Future()
        self._call(session, found, 0, LowerHits(), result.set_result)
        return result.result()

    def close(self) -> None:
        """Stops the sender of probed lookups' calls, once it has sent what was queued."""
        with self._lock:
            sender, self._sender, self._closed = self._sender, None, True
        if sender is not None:
            self._notices.put(None)
            sender.join()
        if self._index is not None:
            self._index.close()

    def _notify(self, notice: Notice) -> None:
        """Queues the call of a lookup the index answered, for the sender thread."""
        with self._lock:
            if self._closed:
                return
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_notices, name="kvtier-lookup-calls", daemon=True
                )
                self._sender.start()
        self._notices.put(notice)

    def _send_notices(self) -> None:
        while (notice := self._notices.get()) is not None:
            session, packed, host, tier_bits = notice
            self._call(session, packed, 0, LowerHits(), _unheard, (host, tier_bits))

    def end(self) -> None:
        """The breaker opened: lookups still waiting are misses now, not at their deadline
        (the requests behind them would wait it out)."""
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def _from_index(self, session: str | None, hashes: Sequence[BlockHash]) -> LowerHits | bytes:
        """The answer, where the index gives it (its call queued for the sender thread) or
        nothing can be asked; else the hashes packed for a call."""
        if session is None or not hashes:
            return LowerHits()
        packed = pack_hashes(hashes)
        if not self._use_index:
            return packed
        self._index_for(session)
        count = len(packed) // HASH_BYTES
        # The call tells the daemon how many host hits the probe found in each of its chunks:
        # the count says it for a lookup of one chunk, a tier byte per hash for several.
        several = count > self._keeper.limits.max_hashes
        tier_bits = np.zeros(count, np.uint8) if several else None
        found = self._index.probe_prefix(packed, tier_bits)
        if found is None or (found.held < count and self._index.has_remote):
            return packed
        self.probed += 1
        self._notify((session, packed, found.host, tier_bits))
        return LowerHits(host=found.host, disk=found.held - found.host)

    def held(self, session: str, hashes: Sequence[BlockHash]) -> np.ndarray | None:
        """Each hash's tier bits in the daemon's lookup index (0: no tier holds it), a hint
        as every probe is; None where there is no index to read."""
        return self._index_for(session).probe(hashes) if self._use_index else None

    def _index_for(self, session: str) -> LookupIndexReader:
        if self._index_session != session:
            # a new session may be a new daemon with a new index at the same path
            if self._index is not None:
                self._index.close()
            self._index = LookupIndexReader(index_path(self._socket, self._signature))
            self._index_session = session
        return self._index

    def _call(
        self,
        session: str,
        packed: bytes,
        start: int,
        hits: LowerHits,
        then: Callable[[LowerHits], None],
        probed: tuple[int, np.ndarray | None] | None = None,
    ) -> None:
        """Looks up the hashes ``packed`` holds from the ``start``-th on, one chunk at a time,
        each from the last's callback, and hands ``then`` the answer; ``probed``: a notice's
        host hits and tier bits."""
        limits = self._keeper.limits
        count = len(packed) // HASH_BYTES
        end = min(count, start + limits.max_hashes)
        request = pb.LookupRequest(
            session_id=session, hashes=packed[start * HASH_BYTES : end * HASH_BYTES]
        )
        if probed is not None:
            host, tier_bits = probed
            if tier_bits is not None:
                host = int(np.count_nonzero(tier_bits[start:end] & HOST))
            request.probed_host = host
        if limits.slot_lookups and end - start == count:
            # Over the session's slot channel where it has one: a round trip there costs a
            # third of a call's. (A lookup of several chunks stays a call: each next chunk is
            # sent from the last one's answer, which the channel's reader thread would run.)
            polled = probed is None  # a notice's answer nobody waits for
            call = self._slot_calls.future("Lookup", request, self._timeout_s, polled)
        else:
            call = self._stub.Lookup.future(
                request, timeout=self._timeout_s, metadata=self._metadata
            )
        with self._lock:
            self._calls.add(call)

        def answered(call: grpc.Future) -> None:
            with self._lock:
                self._calls.discard(call)
            if call.cancelled():  # the client gave up on it: a miss, not a failure
                then(hits)
                return
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                self._failed("Lookup", exc, session)
                then(hits)
                return
            hits.host += reply.host
            hits.disk += reply.disk
            hits.remote += reply.remote
            if reply.host + reply.disk + reply.remote < end - start or end >= count:
                then(hits)
            else:
                self._call(session, packed, end, hits, then, probed)

        call.add_done_callback(answered)
