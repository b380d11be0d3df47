"""Client sessions and the leases on the slots they hold.

Every slot a client reserves or acquires is recorded against its session. A session ends when
the client closes it, when its keep-alive stream breaks (the client died or disconnected), or
when its lease lapses with neither a keep-alive stream nor a call; its reservations are then
aborted and its acquisitions released, so a vanished client leaks nothing and nothing it left
half-written is ever readable. Ownership is checked before any slot operation, so a client can
never commit, abort or release a slot another session holds.

Operations take their slots out of the table first and only then act on the tier, so a session
that ends at the same moment can never give the same slot back twice.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


class SessionError(LookupError):
    """The session does not exist (never opened, closed, or lapsed)."""


class OwnershipError(PermissionError):
    """A slot named in a call is not held by the calling session in the needed way."""


@dataclass(slots=True)
class Session:
    session_id: str
    client_name: str
    block_tokens: int
    deadline: float
    reserved: set[int] = field(default_factory=set)
    acquired: Counter[int] = field(default_factory=Counter)
    streams: int = 0
    """Keep-alive streams open; a session with one never lapses."""
    client_pid: int = 0
    client_pid_ns: int = 0


@dataclass(slots=True)
class Leftovers:
    """What an ended session still held: abort the reservations, release the acquisitions."""

    reserved: list[int]
    acquired: list[int]
    client_pid: int = 0
    client_pid_ns: int = 0


class SessionTable:
    """Thread-safe sessions with lease deadlines on a monotonic clock."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open(
        self, client_name: str, block_tokens: int, client_pid: int = 0, client_pid_ns: int = 0
    ) -> Session:
        session = Session(
            secrets.token_hex(16),
            client_name,
            block_tokens,
            self._clock() + self.lease_s,
            client_pid=client_pid,
            client_pid_ns=client_pid_ns,
        )
        with self._lock:
            self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The live session, its lease renewed; ``SessionError`` if there is none."""
        with self._lock:
            return self._renew(session_id)

    def close(self, session_id: str) -> Leftovers:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionError(f"unknown session {session_id!r:.40}")
        return _leftovers(session)

    def attach(self, session_id: str) -> None:
        """A keep-alive stream opened: the session now lives as long as the stream."""
        with self._lock:
            self._renew(session_id).streams += 1

    def detach(self, session_id: str) -> Leftovers | None:
        """The stream ended. Ends the session (it was the client's lifeline); None if gone."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            session.streams -= 1
            if session.streams > 0:
                return None
            del self._sessions[session_id]
        return _leftovers(session)

    def reap(self) -> list[tuple[Session, Leftovers]]:
        """Ends every session whose lease has lapsed; returns what they held."""
        now = self._clock()
        with self._lock:
            lapsed = [s for s in self._sessions.values() if s.streams == 0 and s.deadline < now]
            for session in lapsed:
                del self._sessions[session.session_id]
        return [(s, _leftovers(s)) for s in lapsed]

    def close_all(self) -> Leftovers:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        reserved: list[int] = []
        acquired: list[int] = []
        for session in sessions:
            left = _leftovers(session)
            reserved += left.reserved
            acquired += left.acquired
        return Leftovers(reserved, acquired)

    # ---- slot ownership ----

    def add_reserved(self, session_id: str, slots: Sequence[int]) -> bool:
        """Records new reservations; False (and nothing recorded) if the session has ended."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            session.reserved.update(slots)
            return True

    def add_acquired(self, session_id: str, slots: Sequence[int]) -> bool:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            session.acquired.update(slots)
            return True

    def take_reserved(self, session_id: str, slots: Sequence[int]) -> None:
        """Removes ``slots`` from the session's reservations, all or none."""
        with self._lock:
            session = self._renew(session_id)
            wanted = set(slots)
            if len(wanted) != len(slots) or not wanted <= session.reserved:
                foreign = sorted(wanted - session.reserved)[:8] or sorted(slots)[:8]
                raise OwnershipError(f"slots not reserved by this session: {foreign}")
            session.reserved -= wanted

    def take_acquired(self, session_id: str, slots: Sequence[int]) -> None:
        """Removes one acquisition per listed slot, all or none."""
        with self._lock:
            session = self._renew(session_id)
            wanted = Counter(slots)
            short = [s for s, n in wanted.items() if session.acquired[s] < n]
            if short:
                raise OwnershipError(f"slots not acquired by this session: {sorted(short)[:8]}")
            session.acquired.subtract(wanted)
            for slot in wanted:
                if session.acquired[slot] == 0:
                    del session.acquired[slot]

    def held(self) -> tuple[int, int]:
        """(reserved, acquired) slot references held across all sessions."""
        with self._lock:
            reserved = sum(len(s.reserved) for s in self._sessions.values())
            acquired = sum(s.acquired.total() for s in self._sessions.values())
        return reserved, acquired

    def _renew(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(f"unknown session {session_id!r:.40}")
        session.deadline = self._clock() + self.lease_s
        return session


def _leftovers(session: Session) -> Leftovers:
    return Leftovers(
        sorted(session.reserved),
        list(session.acquired.elements()),
        session.client_pid,
        session.client_pid_ns,
    )
