"""The engine side of the daemon: a ``LowerTier`` over gRPC and the shared-memory arena.

``DaemonClient`` offers exactly what the in-process ``HostTier`` offers (``lookup``,
``reserve``/``commit``/``abort``, ``acquire``/``release``, ``slab``, ``counters``), so
``build_stack`` and the fall-through walk run unchanged with the lower tiers behind a daemon.

It never raises into the engine for daemon trouble. Every call has a deadline; when the daemon
is down, slow or refuses, a lookup is a miss, a reserve is ``NO_SPACE`` and an acquire is
empty, each counted in ``failures``. A failed call that may have changed slots on the daemon
(reserve, commit, abort, acquire, release) gives up the whole session, so the daemon gets every
slot of it back. A background thread then opens a new session once the engine has handed back
every slot of the old one (so a slot id can never mean two things), re-maps the arena if the
daemon restarted, and holds the session's keep-alive stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future

import grpc

from kvtier.connector.arena import ArenaView
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host import NO_SPACE, LowerHits

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    *contract.CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_MAX_BACKOFF_S = 2.0


class DaemonClient:
    """A ``LowerTier`` whose host and disk tiers live in a ``kvtier serve`` daemon.

    ``target`` is ``unix:/path`` or ``host:port`` (default: the socket of the daemon called
    ``name``). ``token`` (default ``$KVTIER_TOKEN``) is sent with every call, which a TCP
    listener requires. ``timeout_s`` bounds every call but ``Commit``, which waits up to
    ``commit_timeout_s`` for the daemon's disk tier to make the blocks durable.
    ``map_arena=False`` skips mapping the shared arena, for a client that only looks up (a
    scheduler process): ``slab`` then stays empty.
    """

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
        commit_timeout_s: float = 10.0,
        map_arena: bool = True,
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
        self.commit_timeout_s = commit_timeout_s
        self.map_arena = map_arena
        self.counters = TierCounters("host")
        self.failures = 0
        self.sessions_opened = 0
        # On this host the daemon can see whether this process is gone (pid + pid namespace).
        self._local_identity = (
            {"client_pid": os.getpid(), "client_pid_ns": contract.pid_namespace()}
            if self.target.startswith("unix:")
            else {}
        )
        self._arena = ArenaView(block_bytes)
        self.slab = self._arena.slab
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.KvTierStub(self._channel)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._session: str | None = None
        self._daemon_id: str | None = None
        self._max_hashes = contract.MAX_HASHES
        self._reserved: set[int] = set()
        self._acquired: Counter[int] = Counter()
        self._unsettled: list[grpc.Future] = []
        self._keepalive: grpc.Future | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._maintain, name="kvtier-client", daemon=True)
        self._thread.start()

    # ---- state ----

    @property
    def connected(self) -> bool:
        return self._session is not None

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Blocks until a session is open (or ``timeout``); True if one is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._session is not None, timeout)

    def close(self) -> None:
        """Ends the session (the daemon gets back any slot still held) and the channel."""
        self._closing.set()
        with self._lock:
            session, self._session = self._session, None
            keepalive = self._keepalive
            self._changed.notify_all()
        if keepalive is not None:
            keepalive.cancel()
        if session is not None:
            try:
                self._stub.Close(
                    pb.SessionRequest(session_id=session),
                    timeout=self.timeout_s,
                    metadata=self._metadata,
                )
            except grpc.RpcError as exc:
                log.debug("Close of session %s failed: %r", session[:8], exc.code())
        self._thread.join()
        self._channel.close()
        self._arena.unmap()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- LowerTier ----

    def lookup(self, hashes: Sequence[BlockHash]) -> LowerHits:
        session = self._session
        if session is None or not hashes:
            self.failures += session is None and bool(hashes)
            return LowerHits()
        hits = LowerHits()
        for start in range(0, len(hashes), self._max_hashes):
            chunk = hashes[start : start + self._max_hashes]
            request = pb.LookupRequest(session_id=session, hashes=_pack(chunk))
            try:
                reply = self._stub.Lookup(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                self._trouble("Lookup", exc, session, stateful=False)
                return hits
            hits.host += reply.host
            hits.disk += reply.disk
            if reply.host + reply.disk < len(chunk):
                break
        return hits

    def lookup_async(self, hashes: Sequence[BlockHash]) -> Future[LowerHits]:
        """``lookup`` without waiting: the future resolves to its answer and never raises.

        Daemon trouble resolves it to the hits of the chunks answered so far (a miss),
        counted in ``failures``. Chunks are asked one after another, each only if the
        previous one was a full hit.
        """
        answer: Future[LowerHits] = Future()
        session = self._session
        if session is None or not hashes:
            self.failures += session is None and bool(hashes)
            answer.set_result(LowerHits())
            return answer
        hits = LowerHits()

        def ask(start: int) -> None:
            chunk = hashes[start : start + self._max_hashes]
            request = pb.LookupRequest(session_id=session, hashes=_pack(chunk))
            call = self._stub.Lookup.future(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
            call.add_done_callback(lambda call: answered(call, start + len(chunk)))

        def answered(call: grpc.Future, end: int) -> None:
            try:
                reply = call.result()
            except grpc.FutureCancelledError:
                answer.set_result(hits)
                return
            except grpc.RpcError as exc:
                self._trouble("Lookup", exc, session, stateful=False)
                answer.set_result(hits)
                return
            hits.host += reply.host
            hits.disk += reply.disk
            if hits.total < end or end >= len(hashes):
                answer.set_result(hits)
            else:
                ask(end)

        ask(0)
        return answer

    def reserve(
        self, hashes: Sequence[BlockHash], parents: Sequence[BlockHash] | None = None
    ) -> list[int]:
        """A slot per hash, ``ALREADY_STORED`` or ``NO_SPACE``; ``parents`` feed events."""
        self.settle()
        session = self._session
        if session is None or len(hashes) > self._max_hashes:
            self.failures += session is None
            return [NO_SPACE] * len(hashes)
        request = pb.ReserveRequest(
            session_id=session,
            hashes=_pack(hashes),
            parent_hashes=_pack(parents) if parents else b"",
        )
        try:
            reply = self._stub.Reserve(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            self._trouble("Reserve", exc, session, stateful=True)
            return [NO_SPACE] * len(hashes)
        slots = list(reply.slots)
        with self._lock:
            if self._session != session:
                return [NO_SPACE] * len(hashes)  # the session ended; the daemon aborted them
            self._reserved.update(s for s in slots if s >= 0)
        return slots

    def commit(self, slots: Sequence[int]) -> bool:
        """Makes the slots readable; True once the daemon confirmed (durable with a disk tier).

        False means the blocks were not stored (counted in ``failures``); the engine may go on.
        """
        return self._finish("Commit", slots, self._reserved_take)

    def abort(self, slots: Sequence[int]) -> None:
        self._finish("Abort", slots, self._reserved_take)

    def acquire(self, hashes: Sequence[BlockHash]) -> list[int]:
        self.settle()
        session = self._session
        if session is None or not hashes or len(hashes) > self._max_hashes:
            self.failures += session is None and bool(hashes)
            return []
        request = pb.AcquireRequest(session_id=session, hashes=_pack(hashes))
        try:
            reply = self._stub.Acquire(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            self._trouble("Acquire", exc, session, stateful=True)
            return []
        slots = list(reply.slots)
        with self._lock:
            if self._session != session:
                return []
            self._acquired.update(slots)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        self._finish("Release", slots, self._acquired_take)

    # ---- bytes through gRPC, for a client that cannot map the arena ----

    def put_blocks(
        self,
        hashes: Sequence[BlockHash],
        blocks: Sequence[bytes],
        parents: Sequence[BlockHash] | None = None,
    ) -> int:
        """Stores whole blocks sent as bytes; returns how many were newly stored."""
        session = self._session
        if session is None:
            self.failures += 1
            return 0
        if len(hashes) != len(blocks) or (parents is not None and len(parents) != len(hashes)):
            raise ValueError("hashes, blocks and parents must have the same length")

        def messages():
            for i, (h, data) in enumerate(zip(hashes, blocks, strict=True)):
                yield pb.PutRequest(
                    session_id=session if i == 0 else "",
                    hash=h,
                    parent_hash=parents[i] if parents else b"",
                    data=bytes(data),
                )

        try:
            reply = self._stub.Put(
                messages(), timeout=self.timeout_s * max(1, len(hashes)), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            self._trouble("Put", exc, session, stateful=False)
            return 0
        return reply.stored

    def get_blocks(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Copies of the held prefix of ``hashes``, as bytes."""
        session = self._session
        if session is None or not hashes:
            self.failures += session is None and bool(hashes)
            return []
        request = pb.GetRequest(session_id=session, hashes=_pack(hashes))
        blocks: list[bytes] = []
        try:
            for reply in self._stub.Get(
                request, timeout=self.timeout_s * max(1, len(hashes)), metadata=self._metadata
            ):
                blocks.append(reply.data)
        except grpc.RpcError as exc:
            self._trouble("Get", exc, session, stateful=False)
        return blocks

    def stats(self) -> pb.StatsResponse | None:
        """The daemon's counters, or None if it cannot be reached."""
        try:
            return self._stub.Stats(
                pb.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            self._trouble("Stats", exc, self._session, stateful=False)
            return None

    # ---- internals ----

    def _finish(self, method: str, slots: Sequence[int], take) -> bool:
        """Hands slots back: to the daemon if they belong to the live session, else locally.

        ``Commit`` waits for the daemon (the blocks are durable and readable when it returns)
        and says whether it was confirmed. ``Release`` and ``Abort`` need no answer, so they
        go out without waiting, keeping a round trip off the engine's path; a failure still
        gives up the session, as for any call that changes slots.
        """
        if not slots:
            return True
        with self._lock:
            take(slots)
            session = self._session
        if session is None:
            return False  # the old session is gone; the daemon already took its slots back
        request = pb.SlotsRequest(session_id=session, slots=slots)
        call = getattr(self._stub, method)
        if method != "Commit":
            future = call.future(request, timeout=self.timeout_s, metadata=self._metadata)
            with self._lock:
                self._unsettled.append(future)
            future.add_done_callback(lambda f: self._settled(method, f, session))
            return True
        try:
            call(request, timeout=self.commit_timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            self._trouble(method, exc, session, stateful=True)
            return False
        return True

    def settle(self) -> None:
        """Waits until the daemon has answered every release and abort sent without waiting.

        Reserve and acquire call it first, so that they see the room those made; failures are
        handled by the calls' own callbacks.
        """
        with self._lock:
            pending, self._unsettled = self._unsettled, []
        for future in pending:
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
                future.result()

    def _settled(self, method: str, future: grpc.Future, session: str) -> None:
        """Callback of a call sent without waiting: failures count as for a waited call."""
        with self._lock, contextlib.suppress(ValueError):
            self._unsettled.remove(future)
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self._trouble(method, exc, session, stateful=True)

    def _reserved_take(self, slots: Sequence[int]) -> None:
        missing = [s for s in slots if s not in self._reserved]
        if missing or len(set(slots)) != len(slots):
            raise ValueError(f"slots {missing[:8] or list(slots)[:8]} are not reserved")
        self._reserved.difference_update(slots)
        self._changed.notify_all()

    def _acquired_take(self, slots: Sequence[int]) -> None:
        wanted = Counter(slots)
        short = [s for s, n in wanted.items() if self._acquired[s] < n]
        if short:
            raise ValueError(f"slots {short[:8]} released more often than acquired")
        self._acquired.subtract(wanted)
        self._acquired = +self._acquired
        self._changed.notify_all()

    def _trouble(
        self, method: str, exc: grpc.RpcError, session: str | None, *, stateful: bool
    ) -> None:
        """Counts a failed call; gives up the session when slots may be out of step."""
        self.failures += 1
        code = exc.code()
        lost = code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.CANCELLED,
        )
        if not (stateful or lost) or session is None:
            log.debug("kvtier %s failed (%r); treated as a miss", method, code)
            return
        with self._lock:
            if self._session != session:
                return
            self._session = None
            keepalive = self._keepalive
            self._changed.notify_all()
        log.warning(
            "kvtier daemon %s: %s failed (%s: %s); misses until reconnected",
            self.target,
            method,
            code.name,
            exc.details(),
        )
        if keepalive is not None:
            keepalive.cancel()  # ends the session on the daemon, which takes its slots back

    def _maintain(self) -> None:
        """Opens sessions and holds their keep-alive streams until ``close``."""
        backoff = 0.05
        while not self._closing.is_set():
            with self._changed:
                self._changed.wait_for(
                    lambda: (
                        self._closing.is_set()
                        or (self._session is None and not self._reserved and not self._acquired)
                    )
                )
            if self._closing.is_set():
                return
            try:
                opened = self._open()
            except grpc.RpcError as exc:
                log.debug("kvtier daemon %s: Open failed (%r)", self.target, exc.code())
                self._closing.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            backoff = 0.05
            self._hold(opened)

    def _open(self) -> pb.OpenResponse:
        request = pb.OpenRequest(
            client_name=self.client_name,
            layout_signature=self.layout_signature,
            block_bytes=self.block_bytes,
            block_tokens=self.block_tokens,
            protocol_version=contract.PROTOCOL_VERSION,
            **self._local_identity,
        )
        return self._stub.Open(request, timeout=self.timeout_s, metadata=self._metadata)

    def _hold(self, opened: pb.OpenResponse) -> None:
        """Publishes the session and blocks on its keep-alive stream until it breaks."""
        if self.map_arena and opened.daemon_id != self._daemon_id:
            # No slot is in use here (the loop waited for that), so re-mapping is safe.
            try:
                self._arena.map(opened.arena_path, opened.arena_bytes, opened.num_slots)
            except (OSError, ValueError) as exc:
                log.error(
                    "kvtier daemon %s: cannot map its arena (%s); misses until fixed",
                    self.target,
                    exc,
                )
                with contextlib.suppress(grpc.RpcError):  # else its lease lapses
                    self._stub.Close(
                        pb.SessionRequest(session_id=opened.session_id),
                        timeout=self.timeout_s,
                        metadata=self._metadata,
                    )
                self._closing.wait(_MAX_BACKOFF_S)
                return
            self._daemon_id = opened.daemon_id
        keepalive = self._stub.KeepAlive(
            pb.SessionRequest(session_id=opened.session_id), metadata=self._metadata
        )
        with self._lock:
            if self._closing.is_set():
                keepalive.cancel()
                return
            self._session = opened.session_id
            self._keepalive = keepalive
            self._max_hashes = opened.max_hashes or contract.MAX_HASHES
            self.sessions_opened += 1
            self._changed.notify_all()
        log.info(
            "kvtier daemon %s: session %s open (%d slots)",
            self.target,
            opened.session_id[:8],
            opened.num_slots,
        )
        try:
            for _ in keepalive:
                pass
            code = "stream ended"
        except grpc.RpcError as exc:
            code = exc.code().name
        with self._lock:
            if self._session == opened.session_id:
                self._session = None
                self.failures += 1
                log.warning("kvtier daemon %s: session lost (%s); reconnecting", self.target, code)
            self._keepalive = None
            self._changed.notify_all()


def _pack(hashes: Sequence[BlockHash]) -> bytes:
    packed = b"".join(hashes)
    if len(packed) != 16 * len(hashes):
        raise ValueError("every block hash must be 16 bytes")
    return packed
