"""The daemon client's session: opening it, holding its keep-alive stream, reconnecting.

A background thread (the keeper) opens a session, maps the layout's arena, and then blocks on
the session's keep-alive stream; the daemon ends the session when that stream breaks. When the
stream breaks or the client gives a session up (a call that may have changed slots failed in a
way it cannot repair), the keeper opens a new one only once the engine has handed back every
slot of the old one (every copy through them has landed), so a slot id can never mean two
things. The new session's Open names the lost ones: that is the daemon's proof that no copy of
this client can still land in their slots, which it fenced until then.

While no slot is in use the keeper also lets go of an arena the daemon no longer has (a
stopped or restarted daemon removed or replaced the file): that mapping alone would keep its
pages, and a restarted daemon needs the room for its new arena. A new arena is mapped, and
page-locked where the engine asked for it, on the keeper's thread before the session that uses
it is published, so the engine's thread never pays for either.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtier.connector.client.arena import ArenaView
from kvtier.connector.tunables import TUNABLES
from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_MAX_LOST = 16
"""Lost sessions named in the next Open (the keeper loses at most one per session it opens)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What the daemon allows one session (from ``OpenResponse``)."""

    max_hashes: int = contract.MAX_HASHES
    max_reserved: int = 1 << 30
    max_acquired: int = 1 << 30
    lookup_hold_s: float = 0.0
    """How long the daemon holds a lookup's host hits for this session's acquire."""
    slot_lookups: bool = False
    """Whether a lookup may go over the session's slot channel or stream (else a call)."""
    reserve_ahead: int = 0
    """How many slots the session may keep reserved ahead of its stores (``ahead``)."""


class SlotLedger:
    """The slots this process holds: reserved ones and acquired ones (with counts)."""

    def __init__(self, lock: threading.Lock):
        self.changed = threading.Condition(lock)
        self.reserved: set[int] = set()
        self.acquired: Counter[int] = Counter()

    @property
    def empty(self) -> bool:
        return not self.reserved and not self.acquired

    def take_reserved(self, slots) -> None:
        """Removes reserved slots, all or none; call with the lock held."""
        missing = [s for s in slots if s not in self.reserved]
        if missing or len(set(slots)) != len(slots):
            raise ValueError(f"slots {missing[:8] or list(slots)[:8]} are not reserved")
        self.reserved.difference_update(slots)
        self.changed.notify_all()

    def take_acquired(self, slots) -> None:
        """Removes one acquisition per slot, all or none; call with the lock held."""
        wanted = Counter(slots)
        short = [s for s, n in wanted.items() if self.acquired[s] < n]
        if short:
            raise ValueError(f"slots {short[:8]} released more often than acquired")
        self.acquired.subtract(wanted)
        self.acquired = +self.acquired
        self.changed.notify_all()


class SessionKeeper:
    """Holds one session at a time on ``stub`` for ``request``'s layout; ``on_open`` runs
    each time one opens."""

    def __init__(
        self,
        stub: pb_grpc.KvTierStub,
        request: pb.OpenRequest,
        arena: ArenaView | None,
        ledger: SlotLedger,
        lock: threading.Lock,
        *,
        target: str,
        metadata,
        timeout_s: float,
        on_open: Callable[[], None] = lambda: None,
        on_lose: Callable[[], None] = lambda: None,
    ):
        self._stub = stub
        self._request = request
        self._arena = arena
        self._ledger = ledger
        self._lock = lock
        self._target = target
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._on_open = on_open
        self._on_lose = on_lose
        self.session: str | None = None
        self.limits = Limits()
        self.sessions_opened = 0
        self.lost = 0
        """Sessions that ended under the client (stream broke, or given up)."""
        self._unnamed: list[str] = []
        """Lost sessions not yet named to the daemon by a successful Open."""
        self._keepalive: grpc.Future | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._maintain, name="kvtier-client", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout: float | None) -> bool:
        with self._ledger.changed:
            return self._ledger.changed.wait_for(lambda: self.session is not None, timeout)

    def give_up(self, session: str | None, why: str) -> None:
        """Ends ``session`` here and on the daemon (which fences its slots until the next Open
        names it)."""
        with self._lock:
            if session is None or self.session != session:
                return
            self.session = None
            self._lose(session)
            keepalive = self._keepalive
            self._ledger.changed.notify_all()
        log.warning("kvtier daemon %s: %s; misses until reconnected", self._target, why)
        if keepalive is not None:
            keepalive.cancel()  # ends the session on the daemon

    def close(self) -> None:
        """Closes the session (the daemon gets back any slot still held) and stops."""
        self._closing.set()
        with self._lock:
            session, self.session = self.session, None
            keepalive = self._keepalive
            self._ledger.changed.notify_all()
        if session is not None:
            # Close before the stream ends: a session that merely lost its stream keeps its
            # slots fenced until this process exits, one closed gives them back at once.
            with contextlib.suppress(grpc.RpcError):
                self._stub.Close(
                    pb.SessionRequest(session_id=session),
                    timeout=self._timeout_s,
                    metadata=self._metadata,
                )
        if keepalive is not None:
            keepalive.cancel()
        self._thread.join()

    def _maintain(self) -> None:
        """Opens sessions and holds their keep-alive streams until ``close``."""
        backoff = 0.05
        refusal = None
        while not self._closing.is_set():
            with self._ledger.changed:
                self._ledger.changed.wait_for(
                    lambda: self._closing.is_set() or (self.session is None and self._ledger.empty)
                )
            if self._closing.is_set():
                return
            if self._arena is not None and self._arena.stale:
                self._arena.unmap()  # no slot is in use (the wait above): nothing reads it
            unsafe = self._unsafe_socket_dir()
            if unsafe:
                if unsafe != refusal:
                    refusal = unsafe
                    log.error("kvtier daemon %s not used: %s", self._target, unsafe)
                self._closing.wait(TUNABLES.max_reopen_backoff_s)
                continue
            request = pb.OpenRequest()
            request.CopyFrom(self._request)
            with self._lock:
                request.lost_sessions.extend(self._unnamed)
            try:
                opened = self._stub.Open(request, timeout=self._timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                refused = exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                if refused and exc.details() != refusal:
                    # The daemon is there and says no (another block size for this layout,
                    # too many layouts or sessions): say why once, and keep trying.
                    refusal = exc.details()
                    log.error("kvtier daemon %s refused a session: %s", self._target, refusal)
                else:
                    log.debug("kvtier daemon %s: Open failed (%r)", self._target, exc.code())
                self._closing.wait(backoff)
                backoff = min(backoff * 2, TUNABLES.max_reopen_backoff_s)
                continue
            backoff = 0.05
            with self._lock:
                del self._unnamed[: len(request.lost_sessions)]
            self._hold(opened)

    def _unsafe_socket_dir(self) -> str | None:
        """Why the unix socket's directory must not be trusted (another user could have put
        a socket of theirs there), or None; TCP targets have no directory to check."""
        if not self._target.startswith("unix:"):
            return None
        path = Path(self._target.removeprefix("unix:").removeprefix("//"))
        try:
            contract.check_socket_dir(path.parent)
        except OSError as exc:
            return str(exc)
        return None

    def _hold(self, opened: pb.OpenResponse) -> None:
        """Publishes the session and blocks on its keep-alive stream until it breaks."""
        if self._arena is not None and not self._arena.maps(opened.arena_path):
            # No slot is in use here (the loop waited for that), so re-mapping is safe.
            try:
                self._arena.map(opened.arena_path, opened.arena_bytes, opened.num_slots)
            except (OSError, ValueError) as exc:
                log.error(
                    "kvtier daemon %s: cannot map its arena (%s); misses until fixed",
                    self._target,
                    exc,
                )
                with contextlib.suppress(grpc.RpcError):  # else its lease lapses
                    self._stub.Close(
                        pb.SessionRequest(session_id=opened.session_id),
                        timeout=self._timeout_s,
                        metadata=self._metadata,
                    )
                self._closing.wait(TUNABLES.max_reopen_backoff_s)
                return
        keepalive = self._stub.KeepAlive(
            pb.SessionRequest(session_id=opened.session_id), metadata=self._metadata
        )
        self._on_open()  # before the session is seen: its first call finds the breaker closed
        with self._lock:
            if self._closing.is_set():
                keepalive.cancel()
                return
            self.session = opened.session_id
            self._keepalive = keepalive
            self.limits = Limits(
                opened.max_hashes or contract.MAX_HASHES,
                opened.max_reserved or Limits.max_reserved,
                opened.max_acquired or Limits.max_acquired,
                opened.lookup_hold_ms / 1000,
                opened.slot_lookups,
                opened.reserve_ahead,
            )
            self.sessions_opened += 1
            self._ledger.changed.notify_all()
        log.info(
            "kvtier daemon %s: session %s open (%d slots)",
            self._target,
            opened.session_id[:8],
            opened.num_slots,
        )
        try:
            for _ in keepalive:
                pass
            why = "stream ended"
        except grpc.RpcError as exc:
            why = exc.code().name
        with self._lock:
            if self.session == opened.session_id:
                self.session = None
                self._lose(opened.session_id)
                log.warning("kvtier daemon %s: session lost (%s); reconnecting", self._target, why)
            self._keepalive = None
            self._ledger.changed.notify_all()

    def _lose(self, session: str) -> None:
        """Counts a session that ended under the client, keeps it for the next Open to name
        and tells ``on_lose``; call with the lock held."""
        self.lost += 1
        self._unnamed.append(session)
        del self._unnamed[:-_MAX_LOST]
        self._on_lose()
