"""Client sessions and the leases on the slots they hold.

Every slot a client reserves or acquires is recorded against its session. A session ends when
the client closes it, when its keep-alive stream breaks (the client died or disconnected), or
when its lease lapses with neither a keep-alive stream nor a call; its reservations are then
aborted and its acquisitions released, so a vanished client leaks nothing and nothing it left
half-written is ever readable. Ownership is checked before any slot operation, so a client can
never commit, abort or release a slot another session holds.

Calls that hand out slots (Reserve, Acquire) carry a client-chosen call id. A client that
stops waiting for one (its deadline passed) sends ``Cancel`` with that id: the slots the call
took come back now, or as soon as the call finishes, so a slow call costs a miss, never a
leak, and the rest of the session goes on.

Operations take their slots out of the table first and only then act on the tier, so a session
that ends at the same moment can never give the same slot back twice.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.service import holds as lookup_holds
from kvtier.service.holds import Hold
from kvtier.service.session_errors import CallCancelled, OwnershipError, SessionError, SessionLimit
from kvtier.service.tunables import TUNABLES

RESERVE, AHEAD, ACQUIRE = "reserve", "ahead", "acquire"
"""What a call took: slots reserved by hash or ahead (unnamed, ``ahead``), or acquired."""


@dataclass(slots=True)
class Session:
    session_id: str
    client_name: str
    layout: bytes
    block_tokens: int
    deadline: float
    peer: str = ""
    """The TCP peer that opened the session; calls from another connection are refused."""
    reserved: set[int] = field(default_factory=set)
    ahead: set[int] = field(default_factory=set)  # those of ``reserved`` reserved ahead
    acquired: Counter[int] = field(default_factory=Counter)
    streams: int = 0
    """Keep-alive streams open; a session with one never lapses."""
    client_pid: int = 0
    client_pid_ns: int = 0
    engine_group: str = ""
    """The engine this session is a part of (its scheduler's and workers' sessions share
    one): an acquire of any of them ends the holds of all of them."""
    holds: dict[bytes, Hold] = field(default_factory=dict)
    """Host hits lookups answered, held (slot pinned) until the acquires or the deadline
    (``service.holds``)."""
    running: set[int] = field(default_factory=set)
    recent: OrderedDict[int, tuple[str, list[int]]] = field(default_factory=OrderedDict)
    cancelled: OrderedDict[int, None] = field(default_factory=OrderedDict)


@dataclass(slots=True)
class Leftovers:
    """What an ended session still held: abort the reservations, release the acquisitions."""

    layout: bytes
    reserved: list[int]
    acquired: list[int]
    session_id: str = ""
    client_pid: int = 0
    client_pid_ns: int = 0
    held: list[int] = field(default_factory=list)
    """Host hits its lookups held: no copy of the client's reads them, so they come back at
    once even when the rest is quarantined."""


class SessionTable:
    """Thread-safe sessions with lease deadlines on a monotonic clock."""

    def __init__(self, lease_s: float, max_sessions: int = 1 << 30, clock=time.monotonic):
        self.lease_s = lease_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self.holds_refused: Counter[bytes] = Counter()
        """Per layout, host hits a lookup could not hold (the session's share was full)."""
        self.holds_expired: Counter[bytes] = Counter()
        """Per layout, holds that reached their deadline before an acquire ended them."""
        self.holds_yielded: Counter[bytes] = Counter()
        """Per layout, holds ended early to give a promotion a slot."""
        self.holds_missed: Counter[bytes] = Counter()
        """Per layout, host hits a client's index probe promised that its lookup's call, which
        holds them, no longer found in the host tier (evicted in between)."""

    def count_missed(self, layout: bytes, hits: int) -> None:
        with self._lock:
            self.holds_missed[layout] += hits

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open(
        self,
        client_name: str,
        layout: bytes,
        block_tokens: int,
        *,
        peer: str = "",
        client_pid: int = 0,
        client_pid_ns: int = 0,
        engine_group: str = "",
    ) -> Session:
        session = Session(
            secrets.token_hex(16),
            client_name,
            layout,
            block_tokens,
            self._clock() + self.lease_s,
            peer=peer,
            client_pid=client_pid,
            client_pid_ns=client_pid_ns,
            engine_group=engine_group,
        )
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimit(
                    f"{len(self._sessions)} sessions are open, the most this daemon allows "
                    "(max_sessions)"
                )
            self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str, peer: str = "") -> Session:
        """The live session, its lease renewed; ``SessionError`` if there is none."""
        with self._lock:
            return self._renew(session_id, peer)

    def peer_of(self, session_id: str) -> str | None:
        """The connection ``session_id`` is bound to; None if there is no such session."""
        with self._lock:
            return getattr(self._sessions.get(session_id), "peer", None)

    def close(self, session_id: str, peer: str = "") -> Leftovers:
        with self._lock:
            session = self._renew(session_id, peer)
            del self._sessions[session_id]
        return _leftovers(session)

    def attach(self, session_id: str, peer: str = "") -> None:
        """A keep-alive stream opened: the session now lives as long as the stream."""
        with self._lock:
            self._renew(session_id, peer).streams += 1

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

    def close_all(self) -> list[Leftovers]:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        return [_leftovers(s) for s in sessions]

    # ---- calls that hand out slots ----

    def begin_call(self, session_id: str, call_id: int, peer: str = "") -> Session:
        """Registers a Reserve or Acquire as running; ``CallCancelled`` if it was cancelled."""
        with self._lock:
            session = self._renew(session_id, peer)
            if call_id:
                if call_id in session.cancelled:
                    raise CallCancelled(f"call {call_id} was cancelled")
                session.running.add(call_id)
            return session

    def end_call(self, session_id: str, call_id: int, kind: str, slots: Sequence[int]) -> bool:
        """Records what a call took for its session; False (nothing recorded) if the session
        ended or the call was cancelled meanwhile: the caller gives the slots back."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            if call_id:
                session.running.discard(call_id)
                if call_id in session.cancelled:
                    return False
                session.recent[call_id] = (kind, list(slots))
                while len(session.recent) > TUNABLES.recent_calls:
                    session.recent.popitem(last=False)
            if kind == ACQUIRE:
                session.acquired.update(slots)
            else:
                session.reserved.update(slots)
                if kind == AHEAD:
                    session.ahead.update(slots)
            return True

    def cancel(self, session_id: str, call_id: int, peer: str = "") -> tuple[str, list[int]]:
        """Undoes a call the client stopped waiting for: returns (kind, slots to give back),
        the slots it took that the session still holds; a call not finished yet gives its slots
        back when it finishes (``end_call`` says so)."""
        with self._lock:
            session = self._renew(session_id, peer)
            session.cancelled[call_id] = None
            while len(session.cancelled) > TUNABLES.cancelled_ids:
                session.cancelled.popitem(last=False)
            kind, slots = session.recent.pop(call_id, (RESERVE, []))
            if kind != ACQUIRE:
                back = [s for s in slots if s in session.reserved]
                session.reserved.difference_update(back)
                session.ahead.difference_update(back)
            else:
                back = []
                for slot in slots:
                    if session.acquired[slot] > 0:
                        session.acquired[slot] -= 1
                        back.append(slot)
                session.acquired = +session.acquired
            return kind, back

    # ---- what lookups hold for the acquire that follows ----

    def renew_holds(
        self, session_id: str, hashes: Sequence[bytes], until: float, at_most: int | None
    ) -> int:
        """How many leading ``hashes`` (at most ``at_most``) the session holds already: each
        of those holds is promised once more, until ``until`` (``holds.renew_prefix``)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return 0
            return lookup_holds.renew_prefix(session.holds, hashes, until, at_most)

    def add_holds(
        self, session_id: str, pinned: Sequence[tuple[bytes, int]], until: float, limit: int
    ) -> list[int]:
        """Keeps ``pinned`` host hits (hash, slot), pinned once each, for the session until
        ``until``; returns the slots whose pin the caller gives back: beyond ``limit`` slots
        held and acquired, the session gone, or held already (its hold keeps a pin of its
        own and gains a promise, within no limit: it takes no other slot)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return [slot for _, slot in pinned]
            room = limit - len(session.holds) - session.acquired.total()
            back, refused = lookup_holds.keep_pinned(session.holds, pinned, until, room)
            self.holds_refused[session.layout] += refused
            return back

    def drop_promises(self, session_id: str, hashes: Sequence[bytes]) -> list[int]:
        """Takes back the promise ``renew_holds`` made of each of ``hashes`` (its lookup was
        not answered after all); returns the slots of the holds that ended."""
        with self._lock:
            session = self._sessions.get(session_id)
            return [] if session is None else lookup_holds.end_promises(session.holds, hashes)

    def take_holds(self, session_id: str, hashes: Sequence[bytes]) -> list[int]:
        """Ends one promise of each hold on ``hashes`` (their acquire has pinned them), of the
        session and of every session of its engine on its layout (the engine's scheduler looks
        up, its workers acquire); returns the slots of the holds that ended, to unpin."""
        with self._lock:
            caller = self._sessions.get(session_id)
            if caller is None:
                return []
            taken: list[int] = []
            for session in self._group_of(caller):
                taken += lookup_holds.end_promises(session.holds, hashes)
            return taken

    def yield_oldest_hold(self, layout: bytes) -> list[int]:
        """Ends the layout's hold nearest its deadline; returns its slot (none if the layout
        has no hold)."""
        with self._lock:
            oldest: tuple[float, Session, bytes] | None = None
            for session in self._sessions.values():
                if session.layout != layout:
                    continue
                for block_hash, held in session.holds.items():
                    if oldest is None or held.until < oldest[0]:
                        oldest = (held.until, session, block_hash)
            if oldest is None:
                return []
            _, session, block_hash = oldest
            held = session.holds.pop(block_hash)
            self.holds_yielded[layout] += 1
            return [held.slot]

    def _group_of(self, caller: Session) -> list[Session]:
        """The caller and, when it names an engine group, that group's sessions on its
        layout; call with the lock held."""
        if not caller.engine_group:
            return [caller]
        return [
            s
            for s in self._sessions.values()
            if s is caller or (s.engine_group == caller.engine_group and s.layout == caller.layout)
        ]

    def expire_holds(self, now: float) -> list[tuple[bytes, list[int]]]:
        """Ends every hold past its deadline; returns (layout, slots) to unpin."""
        expired: list[tuple[bytes, list[int]]] = []
        with self._lock:
            for session in self._sessions.values():
                late = [h for h, held in session.holds.items() if held.until <= now]
                if late:
                    self.holds_expired[session.layout] += len(late)
                    expired.append(
                        (session.layout, lookup_holds.pins_of(session.holds.pop(h) for h in late))
                    )
        return expired

    # ---- slot ownership ----

    def take_reserved(self, session_id: str, slots: Sequence[int], peer: str = "") -> Session:
        """Removes ``slots`` from the session's reservations, all or none."""
        with self._lock:
            session = self._renew(session_id, peer)
            wanted = set(slots)
            if len(wanted) != len(slots) or not wanted <= session.reserved:
                foreign = sorted(wanted - session.reserved)[:8] or sorted(slots)[:8]
                raise OwnershipError(f"slots not reserved by this session: {foreign}")
            session.reserved -= wanted
            session.ahead -= wanted
            return session

    def take_acquired(self, session_id: str, slots: Sequence[int], peer: str = "") -> Session:
        """Removes one acquisition per listed slot, all or none."""
        with self._lock:
            session = self._renew(session_id, peer)
            wanted = Counter(slots)
            short = [s for s, n in wanted.items() if session.acquired[s] < n]
            if short:
                raise OwnershipError(f"slots not acquired by this session: {sorted(short)[:8]}")
            session.acquired.subtract(wanted)
            for slot in wanted:
                if session.acquired[slot] == 0:
                    del session.acquired[slot]
            return session

    def held(self, layout: bytes | None = None) -> tuple[int, int, int, int, int]:
        """(sessions, reserved for stores under way, reserved ahead, acquired, lookup-held)
        slot references, of one layout or all."""
        with self._lock:
            mine = [s for s in self._sessions.values() if layout is None or s.layout == layout]
            ahead = sum(len(s.ahead) for s in mine)
            reserved = sum(len(s.reserved) for s in mine) - ahead
            acquired = sum(s.acquired.total() for s in mine)
            holds = sum(len(s.holds) for s in mine)
        return len(mine), reserved, ahead, acquired, holds

    def _renew(self, session_id: str, peer: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(f"unknown session {session_id!r:.40}")
        if session.peer and peer != session.peer:
            raise OwnershipError("this session belongs to another connection")
        session.deadline = self._clock() + self.lease_s
        return session


def _leftovers(session: Session) -> Leftovers:
    return Leftovers(
        session.layout,
        sorted(session.reserved),
        list(session.acquired.elements()),
        session.session_id,
        session.client_pid,
        session.client_pid_ns,
        lookup_holds.pins_of(session.holds.values()),
    )
