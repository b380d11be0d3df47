"""The engine side of the daemon: a ``LowerTier`` over gRPC and the shared-memory arena.

``DaemonClient`` offers what the in-process ``HostTier`` offers (``lookup``, ``reserve`` /
``commit`` / ``abort``, ``acquire`` / ``release``, ``slab``, ``counters``), so the fall-through
walk runs unchanged with the lower tiers behind a daemon. It never raises into the engine for
daemon trouble: every call has a deadline, and a failure is a miss, ``NO_SPACE`` or a shorter
prefix, counted in ``failures``; a missed deadline opens a circuit breaker (one deadline, not
one per call). Acquires and commits go in chunks, a failed chunk costing that chunk only (a late
acquire is cancelled by its call id, a late commit's slots aborted); only a failure it cannot
repair gives the session up, and ``SessionKeeper`` opens a new one.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc

from kvtier.connector.client.arena import ArenaView, PageLock, PageUnlock
from kvtier.connector.client.circuit import health_probe, leave_breaker, shared_breaker
from kvtier.connector.client.later import LaterCalls
from kvtier.connector.client.lookups import LookupCalls
from kvtier.connector.client.session import SessionKeeper, SlotLedger
from kvtier.connector.client.slot_stream import SlotCalls
from kvtier.connector.client.stores import Committed, StoreCalls
from kvtier.connector.client.tools import ToolCalls
from kvtier.connector.client.wire import pack_hashes
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.lower import LowerHits

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    *contract.CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_TRIPS = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
"""Codes that mean the daemon is not answering: the circuit breaker opens."""
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
"""Codes that mean the session is gone on the daemon (it restarted, or ended the session)."""


class DaemonClient:
    """A ``LowerTier`` whose host and disk tiers live in a ``kvtier serve`` daemon.

    ``target`` is ``unix:/path`` or ``host:port`` (default: the socket of the daemon called
    ``name``). ``token`` (default ``$KVTIER_TOKEN``) is sent with every call, which a TCP
    listener requires. ``timeout_s`` bounds every call; an acquire of ``n`` bytes may take
    ``n / (load_gbps * 1e9)`` seconds more (the daemon may read them from disk), and goes in
    chunks of at most ``chunk_bytes``. ``map_arena=False`` skips mapping the shared arena, for
    a client that only looks up (a scheduler process): ``slab`` then stays empty. Clients of
    one engine name the same ``engine_group``: the host hits one's lookup holds are then
    handed over to another's acquire. ``lookup_index=True`` answers lookups from the daemon's
    shared-memory index (``lookups``); ``slot_stream``, ``slot_channel``: see ``SlotCalls``.
    ``reserve_ahead=True`` keeps slots reserved ahead of the stores where the daemon offers
    it (``stores``): a store then waits for no Reserve, but a block the daemon holds already
    is copied before its Commit finds that out (``commit_later``'s ``not_stored``).
    ``layout_description``: the layout's ``KVLayout.describe()``, which lets ``kvtier stats``
    say what the layout is (tokens per block, layers, heads, dtype) beside its blocks."""

    def __init__(
        self,
        layout_signature: bytes,
        block_bytes: int,
        *,
        block_tokens: int = 0,
        target: str | None = None,
        name: str = contract.DEFAULT_NAME,
        token: str | None = None,
        client_name: str | None = None,
        timeout_s: float = 2.0,
        load_gbps: float = 0.5,
        chunk_bytes: int = 256 << 20,
        map_arena: bool = True,
        engine_group: str = "",
        lookup_index: bool = False,
        slot_stream: bool = True,
        slot_channel: bool = True,
        reserve_ahead: bool = False,
        layout_description: str = "",
    ):
        if len(layout_signature) != 16:
            raise ValueError("layout_signature must be 16 bytes")
        self.layout_signature = bytes(layout_signature)
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.target = target or contract.unix_target(contract.default_socket(name))
        token = token if token is not None else os.environ.get(contract.TOKEN_ENV)
        self._metadata = contract.bearer(token) if token else None
        self.client_name = client_name or f"pid-{os.getpid()}"
        self.timeout_s = timeout_s
        self.load_gbps = load_gbps
        self.reserves_ahead = reserve_ahead
        self._chunk_blocks = max(1, chunk_bytes // block_bytes)
        self.counters = TierCounters("host")
        self.failures = 0
        self._arena = ArenaView(block_bytes)
        self.slab = self._arena.slab
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.KvTierStub(self._channel)
        self._probe = health_probe(self._channel, timeout_s, self._metadata)
        self._lock = threading.Lock()
        self._ledger = SlotLedger(self._lock)
        self._call_ids = itertools.count(1)
        self._end_lookups = lambda: self._lookups.end()
        self.breaker = shared_breaker(self.target, self._probe, self._end_lookups)
        # On this host the daemon can see whether this process is gone (pid + pid namespace).
        unix = self.target.startswith("unix:")
        local = {"client_pid": os.getpid(), "client_pid_ns": contract.pid_namespace()}
        open_request = pb.OpenRequest(
            client_name=self.client_name,
            layout_signature=self.layout_signature,
            block_bytes=block_bytes,
            block_tokens=block_tokens,
            protocol_version=contract.PROTOCOL_VERSION,
            engine_group=engine_group,
            layout_description=layout_description,
            **(local if unix else {}),
        )
        self._keeper = SessionKeeper(
            self._stub,
            open_request,
            self._arena if map_arena else None,
            self._ledger,
            self._lock,
            target=self.target,
            metadata=self._metadata,
            timeout_s=timeout_s,
            on_open=self.breaker.close,
            on_lose=lambda: self._stores.ahead.drop(),
        )
        self.slot_calls = SlotCalls(
            self._stub, self._keeper, self._metadata, self.target, slot_stream, slot_channel
        )
        self._lookups = LookupCalls(
            self._stub,
            self.slot_calls,
            self._keeper,
            self._lock,
            self._failed,
            metadata=self._metadata,
            timeout_s=timeout_s,
            index_of=(self.target.removeprefix("unix:"), self.layout_signature)
            if lookup_index and unix
            else None,
        )
        self.tools = ToolCalls(
            self._stub,
            self._keeper,
            self.breaker,
            self._usable,
            self._failed,
            metadata=self._metadata,
            layout_signature=self.layout_signature,
            timeout_s=timeout_s,
            block_bytes=block_bytes,
            load_gbps=load_gbps,
        )
        self._later = LaterCalls(
            self.slot_calls,
            self._lock,
            self.breaker,
            timeout_s=timeout_s,
            failed=self._failed,
            give_up=self._keeper.give_up,
        )
        self._stores = StoreCalls(self)

    # ---- state ----

    @property
    def connected(self) -> bool:
        return self._keeper.session is not None

    @property
    def sessions_opened(self) -> int:
        return self._keeper.sessions_opened

    @property
    def chunk_blocks(self) -> int:
        """Most blocks one Acquire or Commit names (``chunk_bytes`` worth)."""
        return min(self._chunk_blocks, self._keeper.limits.max_hashes)

    @property
    def lookup_hold_s(self) -> float:
        """How long the daemon holds a lookup's host hits for this client's acquire (0: not)."""
        return self._keeper.limits.lookup_hold_s

    def acquire_room(self) -> int:
        """How many more slot reads this session may hold now (its share of the slots)."""
        return max(0, self._keeper.limits.max_acquired - self._ledger.acquired.total())

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Blocks until a session is open (or ``timeout``); True if one is."""
        return self._keeper.wait_connected(timeout)

    @property
    def page_locked(self) -> bool:
        """Whether the arena mapped now is page-locked by ``page_lock_with``'s function."""
        return self._arena.page_locked

    def page_lock_with(self, lock: PageLock, unlock: PageUnlock) -> None:
        """Page-locks every arena this client maps with ``lock(slab)`` (``cudaHostRegister``
        under the engine's device), on the client's own thread before the session that uses
        it is published, and unlocks it with ``unlock(slab)`` before it is unmapped: a daemon
        restart never locks or unlocks on the engine's thread. The arena mapped now, if any,
        is locked at once on the calling thread."""
        self._arena.page_lock_with(lock, unlock)

    def close(self) -> None:
        """Ends the session (the daemon gets back any slot still held) and the channel."""
        leave_breaker(self.target, self.breaker, self._probe, self._end_lookups)
        self._lookups.close()
        self._stores.close()
        self._keeper.close()
        self.slot_calls.close()
        self._channel.close()
        self._arena.unmap()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- LowerTier ----

    def lookup(self, hashes: Sequence[BlockHash]) -> LowerHits:
        """The prefix of ``hashes`` the daemon's tiers hold (trouble: a miss)."""
        return self._lookups.answer(self._usable(bool(hashes)), hashes)

    def lookup_async(self, hashes: Sequence[BlockHash]) -> Future[LowerHits]:
        """Starts a Lookup without waiting; the future never raises (trouble: a miss)."""
        return self._lookups.ask(self._usable(bool(hashes)), hashes)

    def lookup_then(self, hashes: Sequence[BlockHash], then: Callable[[LowerHits], None]) -> None:
        """``lookup_async`` with no future: ``then(answer)`` at once where the index answers."""
        self._lookups.ask_then(self._usable(bool(hashes)), hashes, then)

    def reserve(
        self, hashes: Sequence[BlockHash], metas: Sequence[bytes] | None = None
    ) -> list[int]:
        """A slot per hash, ``ALREADY_STORED`` or ``NO_SPACE``; ``metas`` (one per hash) is
        the engine's identity of each block, kept with it and echoed in block events. Slots
        the session reserved ahead answer it at once where there are enough (``ahead``)."""
        return self._stores.reserve(hashes, metas)

    def commit(self, slots: Sequence[int]) -> bool:
        """Makes the slots readable; True once the daemon confirmed every one of them.

        False means some were not stored (counted in ``failures``); the engine may go on.
        Slots go in chunks of ``chunk_blocks``: a chunk that fails costs that chunk only.
        """
        return self._stores.commit(slots)

    def commit_later(self, slots: Sequence[int], then: Committed | None = None) -> None:
        """``commit`` without waiting, sent from the client's own thread: ``then(ok,
        not_stored)`` once the daemon answered; ``settle`` waits for that."""
        self._stores.commit_later(slots, then)

    def abort(self, slots: Sequence[int]) -> None:
        self._stores.abort(slots)

    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]:
        return self.acquire_with_sources(hashes)[0]

    def acquire_with_sources(self, hashes: Sequence[BlockHash]) -> tuple[list[int], LowerHits]:
        """Slots holding the held prefix of ``hashes`` (within this session's share of the
        slots), and which tier each came from; give them back with ``release``."""
        acquired: list[int] = []
        sources = LowerHits()
        session = self._usable(bool(hashes))
        if session is None or not self._later.settle_for_next(self.timeout_s):
            return acquired, sources
        wanted = hashes[: self.acquire_room()]
        step = self.chunk_blocks
        for start in range(0, len(wanted), step):
            chunk = wanted[start : start + step]
            call_id = next(self._call_ids)
            request = pb.AcquireRequest(
                session_id=session, hashes=pack_hashes(chunk), call_id=call_id
            )
            deadline = self.timeout_s + len(chunk) * self.block_bytes / (self.load_gbps * 1e9)
            try:
                reply = self.slot_calls.call("Acquire", request, deadline)
            except grpc.RpcError as exc:
                repair = self._later.canceller(session, call_id)
                self._failed("Acquire", exc, session, repair=repair)
                break
            with self._lock:
                if self._keeper.session != session:
                    break
                self._ledger.acquired.update(reply.slots)
            acquired += reply.slots
            sources.host += reply.host
            sources.disk += reply.disk
            sources.remote += reply.remote
            if len(reply.slots) < len(chunk):
                break
        return acquired, sources

    def release(self, slots: Sequence[int]) -> None:
        self._finish("Release", slots, self._ledger.take_acquired)

    def settle(self, timeout: float | None = None) -> bool:
        """Waits until the daemon has answered every call sent without waiting; False (and
        the breaker opened) if it has not within ``timeout``. Reserve and acquire first wait
        so for those not ahead of them on their stream (``LaterCalls.settle_for_next``)."""
        return self._stores.settle(timeout) and self._later.settle(timeout)

    # ---- internals ----

    def _usable(self, counts: bool) -> str | None:
        """The session to call on, or None (counted as a failure when ``counts``) when there
        is none or the breaker is open."""
        session = self._keeper.session
        if session is None or not self.breaker.allow():
            self.failures += counts
            return None
        return session

    def _finish(self, method: str, slots: Sequence[int], take: Callable) -> None:
        """Hands slots back: to the daemon if they belong to the live session, else only
        locally (the old session is gone and the daemon took its slots back)."""
        if not slots:
            return
        with self._lock:
            take(slots)
            session = self._keeper.session
        if session is not None:
            step = self._keeper.limits.max_hashes
            for start in range(0, len(slots), step):
                self._later.send(method, session, slots[start : start + step])

    def _failed(
        self,
        method: str,
        exc: grpc.RpcError,
        session: str | None,
        repair: Callable[[], None] | None = None,
    ) -> None:
        """Counts a failed call; opens the breaker if the daemon is not answering; repairs
        what the call may have changed, or gives the session up if it is gone."""
        self.failures += 1
        code = exc.code()
        if code in _TRIPS:
            self.breaker.trip(f"{method} failed ({code.name})")
        if code in _GONE:
            self._keeper.give_up(session, f"{method} failed ({code.name}: {exc.details()})")
        elif repair is not None and session is not None:
            repair()
        log.debug("kvtier %s failed (%r); treated as a miss", method, code)
